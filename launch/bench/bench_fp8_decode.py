"""GPU benchmark: fp8 decode attention, the Triton kernel against the CUDA kernel of `cuda_fp8_decode`
(kernels/decode_attention_fp8_cuda.py) and its tile variants, at Qwen3-0.6B heads over the context mixes
the engine meets (prints a table). `--bf16`: a bf16 cache, Triton
against the CUDA kernel of `cuda_decode` (kernels/decode_attention_cuda.py) and its tiles.

Run: `python launch/bench/bench_fp8_decode.py [--bf16]`. Each row: one layer's decode attention,
median of `triton.testing.do_bench` (eager launches: the host's launch time shows in the small rows), µs and
TB/s of K/V read. Tiles are (keys per tile / tiles in flight / warps per SM for the split rule).
"""
from __future__ import annotations

import argparse

import torch
import triton.testing

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
import bench_attention
import spmd_engine.kernels.decode_attention_cuda as cuda16
import spmd_engine.kernels.decode_attention_fp8_cuda as fp8_cuda
from bench_attention import HEAD_DIM, NUM_KV_HEADS
from spmd_engine.kernels.decode_attention import paged_decode_attention

BLOCK_SIZE = 16
TILES = {fp8_cuda: ((64, 2, 6), (64, 3, 4), (32, 3, 9), (32, 4, 7), (64, 2, 12)),  # 16 KB a 64-key tile
         cuda16: ((64, 2, 3), (32, 3, 4), (32, 2, 7), (64, 3, 2))}  # 32 KB


def inputs(lengths: list[int], fp8: bool):
    """bench_attention's paged inputs (fp8 caches with per-KV-head scales, or bf16), one query row a sequence."""
    bench_attention.KV_FP8 = fp8
    query, k, v, _, seq_lens, tables = bench_attention.paged_inputs(1, tuple(lengths), BLOCK_SIZE)
    return query, k, v, seq_lens, tables, bench_attention.kv_scales()


def use_tile(module, block_n: int, stages: int, programs_per_sm: int) -> None:
    module.BLOCK_N, module.STAGES, module.PROGRAMS_PER_SM = block_n, stages, programs_per_sm
    module._kernel.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16", action="store_true", help="a bf16 cache and the kernel of cuda_decode")
    fp8 = not parser.parse_args().bf16
    module = fp8_cuda if fp8 else cuda16
    if not torch.cuda.is_available() or not module.usable(torch.device("cuda")):
        raise SystemExit(f"bench_fp8_decode.py needs a CUDA GPU of compute capability {'8.9' if fp8 else '8.0'}+ "
                         "and NVRTC")
    attend = (fp8_cuda.paged_decode_attention_fp8 if fp8 else
              lambda *args, k_scale, v_scale: cuda16.paged_decode_attention_cuda(*args))
    gen = torch.Generator().manual_seed(1)
    uniform = lambda n, lo, hi: sorted((int(x) for x in torch.randint(lo, hi + 1, (n,), generator=gen)),  # noqa: E731
                                       reverse=True)  # the engine starts the longest rows first
    mixes = {"128 x 830": [830] * 128, "129 x 200..2000": uniform(129, 200, 2000),
             "256 x 100..1500": uniform(256, 100, 1500), "256 x 2048": [2048] * 256,
             "32 x 100..1500": uniform(32, 100, 1500), "1 x 1024": [1024]}
    default = (module.BLOCK_N, module.STAGES, module.PROGRAMS_PER_SM)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}; "
          f"CUDA tile default {default}")
    for name, lengths in mixes.items():
        query, k, v, seq_lens, tables, scales = inputs(lengths, fp8)
        kv_bytes = sum(lengths) * NUM_KV_HEADS * HEAD_DIM * 2 * k.element_size()

        def timed(fn) -> str:
            us = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
            return f"{us:7.1f} us ({kv_bytes / us / 1e6:4.2f} TB/s)"

        cells = [f"triton {timed(lambda: paged_decode_attention(query, k, v, seq_lens, tables, 0.088, **scales))}"]
        for tile in TILES[module]:
            use_tile(module, *tile)
            cells.append(f"cuda {'/'.join(map(str, tile))} "
                         + timed(lambda: attend(query, k, v, seq_lens, tables, 0.088, **scales)))
        use_tile(module, *default)
        print(f"{name:>16}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
