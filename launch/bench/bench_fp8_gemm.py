"""GPU A/B of the FP8 (W8A8) matmul paths against the bf16 ones at Qwen3-8B projection shapes.

For each weight shape and M, each path runs over enough distinct weight copies (>= 512 MB of bf16, more than
the L2 holds, as a decode step's 36 layers are) inside one CUDA graph; the replay is timed and divided by the
copy count. Printed: µs per matmul (activation quantization included for fp8) and the speed-up over bf16.
Paths: `bf16` = the engine's `linear` (GEMV at M <= 16, cuBLAS above); `fp8` = `kernels/fp8_matmul.fp8_linear`
with the online recipe (per-channel weights, 128-column activations: GEMV at M <= 16, Triton GEMM above);
`fp8 block` = Qwen's FP8 checkpoints (128 x 128 weight blocks); `fp8 token` = per-channel weights with
per-token activations (cuBLASLt `torch._scaled_mm` above 16 rows). Every kernel compiles in a warm-up first.

Run: `python launch/bench/bench_fp8_gemm.py [--rows 1 16 64 256 2048]`
"""
from __future__ import annotations

import argparse

import torch

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
from spmd_engine.kernels.fp8_matmul import fp8_linear
from spmd_engine.kernels.reference import fp8_quantize_weight_reference
from spmd_engine.models.layers.linear import linear

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
L2_BYTES = 512 << 20


def graph_time_us(fn, copies: int, reps: int = 20) -> float:
    """µs per call of fn(i) for i in range(copies), replayed in one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(copies):  # warm-up: compiles every kernel before capture
            fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps / copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16, 64, 256, 1024, 4096])
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'shape':<8} {'M':>5} {'bf16 us':>9} {'fp8 us':>9} {'x':>6} {'fp8 block':>10} {'x':>6} "
          f"{'fp8 token':>10} {'x':>6}")
    for name, (n, k) in SHAPES.items():
        copies = max(2, L2_BYTES // (n * k * 2))
        w16 = [torch.randn(n, k, device="cuda").div_(k**0.5).to(torch.bfloat16) for _ in range(copies)]
        channel = [fp8_quantize_weight_reference(w, 1, k) for w in w16]
        block = [fp8_quantize_weight_reference(w, 128, 128) for w in w16]
        block = [(q, s.repeat_interleave(128, 0)[:n].contiguous()) for q, s in block]  # one scale row per weight row
        for m in args.rows:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            t16 = graph_time_us(lambda i: linear(x, w16[i]), copies)
            t8 = graph_time_us(lambda i: fp8_linear(x, channel[i][0], channel[i][1], 1, k, 128), copies)
            t8b = graph_time_us(lambda i: fp8_linear(x, block[i][0], block[i][1], 1, 128, 128), copies)
            t8t = graph_time_us(lambda i: fp8_linear(x, channel[i][0], channel[i][1], 1, k, k), copies)
            print(f"{name:<8} {m:>5} {t16:>9.1f} {t8:>9.1f} {t16 / t8:>6.2f} {t8b:>10.1f} {t16 / t8b:>6.2f} "
                  f"{t8t:>10.1f} {t16 / t8t:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
