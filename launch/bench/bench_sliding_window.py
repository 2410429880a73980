"""Sliding-window attention kernels against their bytes and FLOPs at 8 sequences x 8k keys (prints a table), GPU.

Shapes: Gemma 3 270M (4 query heads, 1 KV head, head_dim 256, window 512: its local layers) and Mistral-7B
(32 / 8 / 128, window 4096), each with its window and without (a global layer), bf16, 16-token blocks scattered
over the pool. Rows:
- `decode`: one new token per sequence (`paged_decode_attention`, the split count the engine picks). `MB` is
  the K/V a step must read (the window's keys only), `floor us` that over the device's copy bandwidth
  (measured here: a device-to-device copy, read + write), `of floor` = floor / time.
- `prefill`: the whole 8k prompt of each sequence (`paged_prefill_attention`); `TFLOP/s` counts the
  visible query-key pairs only (a window of W: about S x W pairs instead of S^2 / 2).
Every row checks one sequence against `kernels/reference.py` (rel err).
Run: `python launch/bench/bench_sliding_window.py [--seqs 8] [--keys 8192]`; `--dry` runs a tiny case once
on CPU under TRITON_INTERPRET=1 (no timing) to check the script.
"""
from __future__ import annotations

import argparse
import math
import os

import torch

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)

SHAPES = {"gemma3-270m": (4, 1, 256, 512), "mistral-7b": (32, 8, 128, 4096)}  # Hq, Hkv, head_dim, window


def paged_caches(seqs: int, keys: int, hkv: int, head_dim: int, block_size: int, device: torch.device,
                 dtype: torch.dtype):
    gen = torch.Generator(device=device).manual_seed(0)
    blocks = math.ceil(keys / block_size)
    shape = (seqs * blocks, block_size, hkv, head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    v_cache = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    tables = torch.randperm(seqs * blocks, device=device, generator=gen).to(torch.int32).view(seqs, blocks)
    return k_cache, v_cache, tables


def timed_us(fn, device: torch.device, repeats: int = 50) -> float:
    if device.type != "cuda":
        fn()
        return float("nan")
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=repeats) * 1e3


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device copy (read + write), the decode's floor."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = timed_us(lambda: dst.copy_(src), device)
    return 2 * src.numel() / (us * 1e-6)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def bench_shape(name: str, seqs: int, keys: int, device: torch.device, dtype: torch.dtype, bandwidth: float,
                block_size: int = 16) -> None:
    from spmd_engine.kernels.decode_attention import paged_decode_attention
    from spmd_engine.kernels.prefill_attention import paged_prefill_attention
    from spmd_engine.kernels.reference import paged_attention_reference

    hq, hkv, head_dim, shape_window = SHAPES[name]
    k_cache, v_cache, tables = paged_caches(seqs, keys, hkv, head_dim, block_size, device, dtype)
    scale = head_dim**-0.5
    seq_lens = torch.full((seqs,), keys, dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(1)
    for window in (shape_window, 0):
        label = f"{name} w={window or 'full'}"
        seen = min(window, keys) if window else keys
        # decode: one token per sequence over its (windowed) context
        q = torch.randn(seqs, hq, head_dim, device=device, dtype=dtype, generator=gen)
        out = torch.empty_like(q)
        us = timed_us(lambda: paged_decode_attention(q, k_cache, v_cache, seq_lens, tables, scale, out,
                                                     window=window), device)
        moved = seqs * hkv * seen * head_dim * 2 * k_cache.element_size()
        ref = paged_attention_reference(q[:1], k_cache, v_cache, torch.tensor([0, 1], dtype=torch.int32,
                                        device=device), seq_lens[:1], tables[:1], scale, window=window)
        floor_us = moved / bandwidth * 1e6
        print(f"{label:24s} decode   {us:9.1f} us  {moved / 1e6:9.2f} MB  floor {floor_us:8.1f} us  "
              f"of floor {floor_us / us:5.2f}  rel err {rel_err(out[:1], ref):.1e}")
        # prefill: the whole prompt of every sequence
        q = torch.randn(seqs * keys, hq, head_dim, device=device, dtype=dtype, generator=gen)
        out = torch.empty_like(q)
        cu = torch.arange(0, seqs + 1, dtype=torch.int32, device=device) * keys
        us = timed_us(lambda: paged_prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, scale, keys, out,
                                                      window=window), device, repeats=20)
        pairs = keys * (keys + 1) / 2 if not window else seen * (seen + 1) / 2 + (keys - seen) * seen
        flops = 4 * seqs * hq * head_dim * pairs
        last = min(256, keys)  # the reference over sequence 0's last queries (its scores fit in memory)
        ref = paged_attention_reference(q[keys - last:keys], k_cache, v_cache, cu[:2].clamp_max(last), seq_lens[:1],
                                        tables[:1], scale, window=window)
        print(f"{label:24s} prefill  {us:9.1f} us  {flops / us / 1e6:9.1f} TFLOP/s{'':22s}"
              f"rel err {rel_err(out[keys - last:keys], ref):.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--keys", type=int, default=8192)
    parser.add_argument("--dry", action="store_true", help="a tiny case once on CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    if args.dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        SHAPES.update({"gemma3-270m": (2, 1, 32, 8), "mistral-7b": (2, 2, 16, 12)})
        device, dtype, seqs, keys = torch.device("cpu"), torch.float32, 2, 40
    else:
        device, dtype, seqs, keys = torch.device("cuda"), torch.bfloat16, args.seqs, args.keys
    bandwidth = copy_bandwidth(device)
    print(f"device copy: {bandwidth / 1e12:.2f} TB/s; {seqs} sequences x {keys} keys, {dtype}")
    for name in SHAPES:
        bench_shape(name, seqs, keys, device, dtype, bandwidth)


if __name__ == "__main__":
    main()
