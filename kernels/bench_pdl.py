"""GPU A/B of Programmatic Dependent Launch (`kernels/pdl.py`, engine key `cuda_pdl`) on a decode step.

Why: at batch 1 a Qwen3-0.6B decode step is ~230 small dependent kernels replayed from one CUDA graph;
the gaps between them (launch, CTA dispatch, ramp) are a large share of the inter-token latency. PDL
lets each kernel's launch overlap its predecessor's tail; this measures what that saves.

The step is built from the engine's own kernel functions, Qwen3-0.6B-shaped, each layer with its own
weights and paged KV cache (the weights, ~1.2 GB, far exceed the L2, as in the engine):
28 x [add + RMSNorm, GEMV qkv, fused q/k norm + rotary + KV store, paged decode attention (short
context, split-KV with the fused merge), GEMV o_proj, add + RMSNorm, GEMV gate_up, gated GEMV down]
+ final add + RMSNorm + the float32 LM-head GEMV. The matmuls take the engine's path: above 16 rows
cuBLAS (never PDL) with the SwiGLU gate as the separate `silu_and_mul` launch.

For each batch the step is captured in one CUDA graph with PDL off and again with it on, the replays
timed (median, rounds alternating off/on), and the logits of the two graphs compared bit for bit
(they must be equal: every kernel waits for its predecessor before touching memory).
Run: `PYTHONPATH=. python kernels/bench_pdl.py [--batch 1 256] [--context 256] [--rounds 3]`.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import triton

from spmd_engine.kernels.bench_fused_ops import graph_ms
from spmd_engine.kernels.decode_attention import paged_decode_attention
from spmd_engine.kernels.gemv import GEMV_MAX_M, gemv
from spmd_engine.kernels.pdl import GDC_AVAILABLE, pdl_supported, set_pdl
from spmd_engine.kernels.qk_norm_rope_store import qk_norm_rope_store
from spmd_engine.kernels.rms_norm import rms_norm
from spmd_engine.kernels.silu_and_mul import silu_and_mul

# Qwen3-0.6B
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, EPS = 28, 1024, 16, 8, 128, 3072, 151936, 1e-6
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
DEVICE = "cuda"


def matmul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None, gated: bool = False):
    """The engine's choice (models/layers/linear.py `linear`, not imported: kernels/ is a leaf): the GEMV up
    to GEMV_MAX_M rows on CUDA, else silu_and_mul first when gated and cuBLAS."""
    if x.is_cuda and x.shape[0] <= GEMV_MAX_M:
        return gemv(x, w, out_dtype=out_dtype, gated=gated)
    if gated:
        x = silu_and_mul(x)
    if out_dtype is None or not x.is_cuda:
        return torch.nn.functional.linear(x, w).to(out_dtype or x.dtype)
    return torch.mm(x, w.t(), out_dtype=out_dtype)


class DecodeStep:
    """One decode step's inputs, weights and caches for `batch` sequences of `context` tokens (the new one
    included); `run()` makes the step's launches and writes the float32 logits into `self.logits`."""

    def __init__(self, batch: int, context: int, seed: int = 0) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, device=DEVICE, generator=gen) * scale).to(DTYPE)

        q_width, kv_width = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        self.layers = [dict(
            norm_in=1 + 0.1 * rand(HIDDEN), norm_post=1 + 0.1 * rand(HIDDEN),
            qkv=rand(q_width + 2 * kv_width, HIDDEN, scale=HIDDEN ** -0.5),
            q_norm=1 + 0.1 * rand(HEAD_DIM), k_norm=1 + 0.1 * rand(HEAD_DIM),
            o=rand(HIDDEN, q_width, scale=q_width ** -0.5),
            gate_up=rand(2 * INTER, HIDDEN, scale=HIDDEN ** -0.5),
            down=rand(HIDDEN, INTER, scale=INTER ** -0.5),
        ) for _ in range(LAYERS)]
        self.norm_final = 1 + 0.1 * rand(HIDDEN)
        self.lm_head = rand(VOCAB, HIDDEN, scale=HIDDEN ** -0.5)
        self.hidden, self.residual = rand(batch, HIDDEN), rand(batch, HIDDEN)
        # each sequence's blocks scattered over the pool; the new token's slot is its last position
        blocks_per_seq = -(-context // BLOCK_SIZE)
        num_blocks = batch * blocks_per_seq
        order = torch.randperm(num_blocks, device=DEVICE, generator=gen).to(torch.int32)
        self.block_tables = order.view(batch, blocks_per_seq).contiguous()
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
        last = context - 1
        self.slots = (self.block_tables[:, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE)
        shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.caches = [(rand(*shape), rand(*shape)) for _ in range(LAYERS)]
        angles = torch.rand(batch, HEAD_DIM // 2, device=DEVICE, generator=gen) * context
        self.cos, self.sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
        self.logits = torch.empty(batch, VOCAB, dtype=torch.float32, device=DEVICE)
        self.batch = batch

    def run(self) -> None:
        b, q_width, kv_width = self.batch, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        hidden, residual = self.hidden, self.residual
        for layer, (k_cache, v_cache) in zip(self.layers, self.caches):
            h, residual = rms_norm(hidden, layer["norm_in"], EPS, residual)
            qkv = matmul(h, layer["qkv"])
            q = qkv[:, :q_width].view(b, HEADS, HEAD_DIM)
            k = qkv[:, q_width:q_width + kv_width].view(b, KV_HEADS, HEAD_DIM)
            v = qkv[:, q_width + kv_width:].view(b, KV_HEADS, HEAD_DIM)
            q = qk_norm_rope_store(q, k, v, self.cos, self.sin, k_cache, v_cache, self.slots,
                                   layer["q_norm"], layer["k_norm"], EPS)
            attn = paged_decode_attention(q, k_cache, v_cache, self.seq_lens, self.block_tables, HEAD_DIM ** -0.5)
            o = matmul(attn.view(b, q_width), layer["o"])
            h, residual = rms_norm(o, layer["norm_post"], EPS, residual)
            hidden = matmul(matmul(h, layer["gate_up"]), layer["down"], gated=True)
        h, _ = rms_norm(hidden, self.norm_final, EPS, residual)
        self.logits.copy_(matmul(h, self.lm_head, out_dtype=torch.float32))


def timed(step: DecodeStep, on: bool) -> tuple[float, torch.Tensor]:
    """(median ms per graph replay, the replay's logits) with PDL on or off for the capture."""
    set_pdl(on)
    try:
        ms = graph_ms(step.run)  # warm-up (compiles this PDL setting's kernels), capture, timed replays
    finally:
        set_pdl(False)
    torch.cuda.synchronize()
    return ms, step.logits.clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 256], help="decode rows per step")
    parser.add_argument("--context", type=int, default=256, help="tokens per sequence (the new one included)")
    parser.add_argument("--rounds", type=int, default=3, help="off/on timings per batch (medians reported)")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          "CUDA", torch.version.cuda)
    if not pdl_supported(device):
        print(f"PDL cannot run here (compute capability {torch.cuda.get_device_capability()}, "
              f"gdc in Triton: {GDC_AVAILABLE}): nothing to compare")
        return
    print(f"Qwen3-0.6B-shaped decode step, {LAYERS} layers, context {args.context}, one CUDA graph per setting")
    print(f"{'batch':>6} {'PDL off ms':>11} {'PDL on ms':>10} {'saved us':>9} {'saved %':>8} {'same bits':>9}  rounds")
    with torch.inference_mode():
        for batch in args.batch:
            step = DecodeStep(batch, args.context)
            off, on, same = [], [], True
            reference = None
            for _ in range(args.rounds):
                t_off, logits_off = timed(step, False)
                t_on, logits_on = timed(step, True)
                off.append(t_off)
                on.append(t_on)
                reference = logits_off if reference is None else reference
                same &= torch.equal(logits_off, reference) and torch.equal(logits_on, reference)
            t_off, t_on = statistics.median(off), statistics.median(on)
            rounds = " ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(off, on))
            print(f"{batch:>6} {t_off:>11.3f} {t_on:>10.3f} {1000 * (t_off - t_on):>9.1f} "
                  f"{100 * (t_off - t_on) / t_off:>7.1f}% {'yes' if same else 'NO':>9}  {rounds}")
            del step
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
