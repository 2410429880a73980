"""GPU A/B of the small-batch GEMV (`kernels/gemv.py`) against cuBLAS at Qwen3 decode shapes.

For each weight shape and M in 1, 2, 4, 8, 16 both kernels run over enough distinct weight copies
(>= 256 MB, more than the L2 holds, as a decode step's 28 layers are) inside one CUDA graph; the
replay is timed and divided by the copy count, so each figure is one matmul as the engine's decode
graphs run it, launch gaps included. Printed: µs per matmul and the GB/s of W + x + y that it
reaches, then per model the sum over one decode step (layers x 4 projections + the LM head).
Pick `SMALL_BATCH_MAX_M` (models/layers/linear.py) from the last M where the GEMV still wins.

`--sweep` also times a few block choices per shape at M=1 and M=16 and prints the best as
`GEMV_TABLE` entries to paste into kernels/gemv.py.

Run: `PYTHONPATH=. python kernels/bench_gemv.py [--model qwen3|qwen3_8b|all] [--sweep | --sweep-only]`.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.testing

from spmd_engine.kernels.bench_fused_ops import graph_ms
from spmd_engine.kernels.gemv import GemvConfig, gemv, gemv_config

# name -> (layers, hidden, q heads x head_dim, kv heads x head_dim, intermediate, vocab)
MODELS = {"qwen3": (28, 1024, 2048, 1024, 3072, 151936), "qwen3_8b": (36, 4096, 4096, 1024, 12288, 151936)}
BATCHES = (1, 2, 4, 8, 16)
MIN_BYTES = 256 << 20  # weight bytes per timed graph: far above the H200's 50 MB L2
DTYPE = torch.bfloat16
DEVICE = "cuda"


def model_shapes(name: str) -> dict[str, tuple[int, int, int]]:
    """projection -> (N, K, count per decode step)."""
    layers, hidden, q, kv, inter, vocab = MODELS[name]
    return {"qkv": (q + 2 * kv, hidden, layers), "o_proj": (hidden, q, layers),
            "gate_up": (2 * inter, hidden, layers), "down": (hidden, inter, layers), "lm_head": (vocab, hidden, 1)}


def graph_us(fn, calls: int) -> float:
    """Median µs per matmul of `fn` (which makes `calls` of them) replayed from a CUDA graph."""
    return 1000 * graph_ms(fn) / calls


class Case:
    """Distinct weight copies of one (N, K) and an x of each M."""

    def __init__(self, n: int, k: int) -> None:
        self.n, self.k = n, k
        copies = max(1, -(-MIN_BYTES // (n * k * 2)))
        self.weights = [torch.randn(n, k, device=DEVICE, dtype=DTYPE) * k**-0.5 for _ in range(copies)]
        self.xs = {m: torch.randn(m, k, device=DEVICE, dtype=DTYPE) for m in BATCHES}

    def bytes(self, m: int) -> int:
        return 2 * (self.n * self.k + m * self.k + m * self.n)

    def time(self, m: int, kind: str, config: GemvConfig | None = None) -> float:
        """kind: cublas | gemv | gemv2 (split-K summed by a second launch)."""
        x = self.xs[m]
        if kind == "cublas":
            def run():
                for w in self.weights:
                    torch.mm(x, w.t())
        else:
            def run():
                for w in self.weights:
                    gemv(x, w, config=config, one_launch=kind == "gemv")
        return graph_us(run, len(self.weights))


def compare(name: str) -> None:
    print(f"\n{name} ({DTYPE}): µs per matmul (GB/s of W + x + y)")
    print("(gemv 2-launch: split-K summed by a second kernel, SPLIT_K_ONE_LAUNCH=False)")
    print(f"{'proj':>8} {'N':>7} {'K':>6} {'M':>3} {'cuBLAS':>15} {'gemv':>15} {'gemv 2-launch':>15} "
          f"{'speed-up':>9}  config")
    totals = {m: [0.0, 0.0, 0.0] for m in BATCHES}
    for proj, (n, k, count) in model_shapes(name).items():
        case = Case(n, k)
        cfg = gemv_config(n, k, 2)
        for m in BATCHES:
            times = [case.time(m, kind) for kind in ("cublas", "gemv", "gemv2")]
            cells = []
            for i, t in enumerate(times):
                totals[m][i] += count * t
                cells.append(f"{t:>7.1f} ({case.bytes(m) / t / 1e3:>5.0f})")
            print(f"{proj:>8} {n:>7} {k:>6} {m:>3} {' '.join(cells)} {times[0] / times[1]:>8.2f}x  "
                  f"{cfg.block_n}x{cfg.block_k} split {cfg.split_k}")
        del case
        torch.cuda.empty_cache()
    print(f"{name}: one decode step's matmuls (layers x 4 + LM head), ms")
    for m, (t_cublas, t_gemv, t_gemv2) in totals.items():
        print(f"  M={m:>2}: cuBLAS {t_cublas / 1e3:.3f}  gemv {t_gemv / 1e3:.3f}  gemv 2-launch {t_gemv2 / 1e3:.3f}  "
              f"saved {(t_cublas - t_gemv) / 1e3:+.3f}")


def candidates(n: int, k: int) -> list[GemvConfig]:
    """The heuristic's choice and its neighbours: 32/64/128-row tiles, 128/256-wide K steps, 1-16 splits
    (each an exact split of the K steps) giving 128..1056 programs, shared memory under ~200 KB."""
    out = {gemv_config(n, k, 2)}
    for block_n, block_k, split in itertools.product((32, 64, 128), (128, 256), (1, 2, 3, 4, 6, 8, 12, 16)):
        k_tiles, programs = triton.cdiv(k, block_k), triton.cdiv(n, block_n) * split
        if split > k_tiles or triton.cdiv(k_tiles, triton.cdiv(k_tiles, split)) != split:
            continue
        if split > 1 and not 128 <= programs <= 4 * 264:
            continue
        stages = 4 if (block_n + 16) * block_k * 2 * 4 <= 200 << 10 else 3
        out.add(GemvConfig(block_n, block_k, split, 8 if block_n == 128 else 4, stages))
    return sorted(out, key=lambda c: (c.block_n, c.block_k, c.split_k))


def sweep(name: str) -> None:
    print(f"\n{name}: block choices by µs at M=1 (M=16 alongside); the first line per shape is the heuristic's")
    table = []
    for proj, (n, k, _) in model_shapes(name).items():
        case = Case(n, k)
        default = gemv_config(n, k, 2)
        results = []
        for cfg in candidates(n, k):
            try:
                results.append((case.time(1, "gemv", cfg), case.time(16, "gemv", cfg), cfg))
            except Exception as err:  # noqa: BLE001 - a choice this GPU cannot run (shared memory): skip it
                print(f"{'':>10} skipped {cfg}: {type(err).__name__}")
        results.sort(key=lambda r: r[0])
        base = next(r for r in results if r[2] == default)
        print(f"{proj:>8} {n}x{k}: heuristic {base[0]:.1f} / {base[1]:.1f} µs ({default})")
        for t1, t16, cfg in results[:3]:
            print(f"{'':>10} {t1:>7.1f} / {t16:>7.1f} µs  {cfg}")
        table.append(f"    ({n}, {k}, 2): {results[0][2]!r},  # {proj}: {results[0][0]:.1f} µs at M=1")
        del case
        torch.cuda.empty_cache()
    print("GEMV_TABLE entries (kernels/gemv.py):\n" + "\n".join(table))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--sweep", action="store_true", help="also time block choices per shape")
    parser.add_argument("--sweep-only", action="store_true", help="the sweep without the cuBLAS comparison")
    args = parser.parse_args()
    names = list(MODELS) if args.model == "all" else [args.model]
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for name in names if not args.sweep_only else []:
        compare(name)
    if args.sweep or args.sweep_only:
        for name in names:
            sweep(name)


if __name__ == "__main__":
    main()
