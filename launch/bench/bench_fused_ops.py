"""GPU A/B of the fused small ops against the torch ops they replace, per Qwen3-0.6B decode step.

One step's non-matmul, non-attention work (28 layers x: residual add + RMSNorm twice, per-head q/k
RMSNorm (one launch for both), rotary on q and k, SiLU-and-mul; at small batch the engine folds
the SiLU-and-mul into the down_proj GEMV instead, see launch/bench/bench_gemv.py) is captured in a CUDA
graph both ways and the replays are timed, so launch gaps count as they do in the engine's decode
graphs. Also checks the fused
outputs against the torch ones.

Second table: the attention prologue per layer (q/k per-head norm, rotary on q and k, the KV store,
bf16 and fp8 caches), today's four Triton launches (rms_norm_pair, apply_rotary x2, store_kv) against
the one `qk_norm_rope_store` launch, 28 layers per graph; "same bits" compares q and both caches byte
for byte. Run: `python launch/bench/bench_fused_ops.py`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton.testing

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
from spmd_engine.kernels.kv_quant import FP8_DTYPE
from spmd_engine.kernels.kv_store import store_kv
from spmd_engine.kernels.qk_norm_rope_store import qk_norm_rope_store, rows_per_program
from spmd_engine.kernels.rms_norm import rms_norm, rms_norm_pair
from spmd_engine.kernels.rotary import apply_rotary
from spmd_engine.kernels.silu_and_mul import silu_and_mul
from tests.helpers.graph_capture import capture

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, EPS = 28, 1024, 16, 8, 128, 3072, 1e-6  # Qwen3-0.6B


def torch_norm(x, w, residual=None):
    if residual is not None:
        x = x + residual
    x32 = x.float()
    out = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    return out if residual is None else (out, x)


def torch_rotary(x, cos, sin):
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def torch_silu(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_norm(x, w, residual=None):
    return rms_norm(x, w, EPS, residual)


def torch_qk_norm(q, wq, k, wk):
    return torch_norm(q, wq), torch_norm(k, wk)


def fused_qk_norm(q, wq, k, wk):
    return rms_norm_pair(q, wq, k, wk, EPS)


def step(tokens: int, norm, qk_norm, rotary, silu):
    """Build inputs once; return a closure doing one step's small ops (all layers)."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    hidden, residual, w = rand(tokens, HIDDEN), rand(tokens, HIDDEN), 1 + 0.1 * rand(HIDDEN)
    qkv = rand(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    gate_up, wq, wk = rand(tokens, 2 * INTER), 1 + 0.1 * rand(HEAD_DIM), 1 + 0.1 * rand(HEAD_DIM)
    angles = torch.rand(tokens, HEAD_DIM // 2, device="cuda", generator=gen) * 100
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)

    def run():
        outs = []
        for _ in range(LAYERS):
            h, r = norm(hidden, w, residual)
            q = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
            k = qkv[:, HEADS * HEAD_DIM: (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
            q, k = qk_norm(q, wq, k, wk)
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
            h2, r2 = norm(h, w, r)
            outs = [h2, r2, q, k, silu(gate_up)]
        return outs

    return run


def graph_ms(fn) -> float:
    """Median ms of one replay of fn captured in a CUDA graph (launch gaps count as in the engine's graphs)."""
    graph, _ = capture(fn)
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")


def prologue(tokens: int, fused: bool, fp8: bool):
    """All layers' q/k norm + rotary + KV store over one step's qkv; a closure returning (q, k_cache, v_cache).
    Every token has its own slot, but every eighth is padding (-1), as in a piecewise bucket."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", generator=gen).to(torch.bfloat16)
    q = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM: (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(tokens, KV_HEADS, HEAD_DIM)
    wq, wk = (1 + 0.1 * torch.randn(2, HEAD_DIM, device="cuda", generator=gen)).to(torch.bfloat16).unbind(0)
    angles = torch.rand(tokens, HEAD_DIM // 2, device="cuda", generator=gen) * 100
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    block = 16
    slots = torch.randperm(-(-tokens // block) * block, device="cuda", generator=gen)[:tokens]
    slots[7::8] = -1
    shape = (-(-tokens // block), block, KV_HEADS, HEAD_DIM)
    k_cache = torch.zeros(shape, device="cuda", dtype=FP8_DTYPE if fp8 else torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    scales = {"k_scale": torch.full((KV_HEADS,), 0.5, device="cuda"),
              "v_scale": torch.full((KV_HEADS,), 0.25, device="cuda")} if fp8 else {}

    def run():
        for _ in range(LAYERS):
            if fused:
                q_out = qk_norm_rope_store(q, k, v, cos, sin, k_cache, v_cache, slots, wq, wk, EPS, **scales)
            else:
                qn, kn = rms_norm_pair(q, wq, k, wk, EPS)
                q_out, k_rot = apply_rotary(qn, cos, sin), apply_rotary(kn, cos, sin)
                store_kv(k_rot, v, k_cache, v_cache, slots, **scales)
        return q_out, k_cache, v_cache

    return run


def main() -> None:
    print(f"{'tokens':>7} {'torch ops ms':>13} {'fused ms':>9} {'saved ms':>9} {'max rel err':>12}")
    for tokens in (1, 64, 256, 8192):
        eager = step(tokens, torch_norm, torch_qk_norm, torch_rotary, torch_silu)
        fused = step(tokens, fused_norm, fused_qk_norm, apply_rotary, silu_and_mul)
        err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(fused(), eager()))
        t_eager, t_fused = graph_ms(eager), graph_ms(fused)
        print(f"{tokens:>7} {t_eager:>13.3f} {t_fused:>9.3f} {t_eager - t_fused:>9.3f} {err:>12.2e}")
    print(f"\nq/k norm + rotary + KV store, {LAYERS} layers per graph (us per layer in brackets)")
    print(f"{'tokens':>7} {'cache':>6} {'heads/prog':>10} {'4 launches ms':>14} {'fused ms':>16} {'saved ms':>9} "
          f"{'same bits':>9}")
    for tokens in (1, 256, 1024, 8192):
        for fp8 in (False, True):
            unfused, fused = prologue(tokens, False, fp8), prologue(tokens, True, fp8)
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fused(), unfused()))
            t_unfused, t_fused = graph_ms(unfused), graph_ms(fused)
            per_layer = f"{t_fused:.3f} ({1000 * t_fused / LAYERS:.1f})"
            print(f"{tokens:>7} {'fp8' if fp8 else 'bf16':>6} {rows_per_program(tokens, HEADS, KV_HEADS, True):>10} "
                  f"{t_unfused:>14.3f} {per_layer:>16} {t_unfused - t_fused:>9.3f} {'yes' if same else 'NO':>9}")


if __name__ == "__main__":
    main()
