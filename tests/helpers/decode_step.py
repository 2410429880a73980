"""A Qwen3-0.6B-shaped decode step built from the engine's own kernel functions (CUDA only).

Why here: tests/gpu/test_pdl.py checks its bits with PDL on and off, and launch/bench/bench_pdl.py and
bench_gemv.py time it in one CUDA graph; all three must run the same step.

28 layers (`layers`), each with its own weights and paged KV cache (the weights, ~1.2 GB, far exceed the
L2, as in the engine) of [add + RMSNorm, GEMV qkv, fused q/k norm + rotary + KV store, paged decode attention
(split-KV with the fused merge), GEMV o_proj, add + RMSNorm, GEMV gate_up, gated GEMV down] + final add +
RMSNorm + the float32 LM-head GEMV. The matmuls take the engine's path: above 16 rows cuBLAS (never PDL) with
the SwiGLU gate as the separate `silu_and_mul` launch.
"""
from __future__ import annotations

import torch

from spmd_engine.kernels.decode_attention import paged_decode_attention
from spmd_engine.kernels.gemv import GEMV_MAX_M, gemv
from spmd_engine.kernels.qk_norm_rope_store import qk_norm_rope_store
from spmd_engine.kernels.rms_norm import rms_norm
from spmd_engine.kernels.silu_and_mul import silu_and_mul

# Qwen3-0.6B
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, EPS = 28, 1024, 16, 8, 128, 3072, 151936, 1e-6
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
DEVICE = "cuda"


def matmul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None, gated: bool = False):
    """The engine's choice (models/layers/linear.py `linear`, restated on the kernels alone): the GEMV up
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

    def __init__(self, batch: int, context: int, seed: int = 0, layers: int = LAYERS) -> None:
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
        ) for _ in range(layers)]
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
        self.caches = [(rand(*shape), rand(*shape)) for _ in range(layers)]
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
