"""GPU A/B of the small-batch GEMV (`kernels/gemv.py`) against cuBLAS at Qwen3 decode shapes.

For each weight shape and M in 1, 2, 4, 8, 16 both kernels run over enough distinct weight copies
(>= 256 MB, more than the L2 holds, as a decode step's 28 layers are) inside one CUDA graph; the
replay is timed and divided by the copy count, so each figure is one matmul as the engine's decode
graphs run it, launch gaps included. Printed: µs per matmul and the GB/s of W + x + y that it
reaches, then per model the sum over one decode step (layers x 4 projections + the LM head). `gemv` is
the one-launch kernel the engine runs (the last program of an N tile sums the split-K partials); `gemv
2-launch` sums them by the tests' second-launch oracle (tests/helpers/split_oracles.py), the cost of a
second launch.
Pick `SMALL_BATCH_MAX_M` (models/layers/linear.py) from the last M where the GEMV still wins.

`--sweep` also times a few block choices per shape at M=1 and M=16 and prints the best as
`GEMV_TABLE` entries to paste into kernels/gemv.py.

`--in-situ` chooses the blocks where they run: the whole batch-1 Qwen3-0.6B decode step of
`launch/bench/bench_pdl.py` (PDL on, one CUDA graph) is timed while one shape's choice varies, shape after
shape (coordinate descent, `--rounds` passes), and the winners are printed as `GEMV_TABLE` entries.
Why: with PDL a GEMV's launch and ramp overlap its neighbours, so the isolated `--sweep` misjudges
(H200, batch 1, context 1024: its choices gave 1074 us per step, the in-situ ones 980). Confirm a new table
with the engine's batch-1 bench (`python run.py model=qwen3 model.load_format=dummy workload=bench
workload.num_seqs=1`, GPU busy per step) before keeping it: picks worth 2-4 us here cost 29 us there.

Run: `python launch/bench/bench_gemv.py [--model qwen3|qwen3_8b|all] [--sweep | --sweep-only]`,
or `python launch/bench/bench_gemv.py --in-situ [--context 1024] [--rounds 2]` (~2 min a round).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import statistics

import torch
import triton
import triton.testing

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
from bench_fused_ops import graph_ms
from spmd_engine.kernels.gemv import GEMV_TABLE, GemvConfig, gemv, gemv_config
from spmd_engine.kernels.pdl import pdl_launches
from tests.helpers.decode_step import DecodeStep
from tests.helpers.split_oracles import second_launch_reductions

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
        """kind: cublas | gemv | gemv2 (split-K summed by the tests' second launch)."""
        x = self.xs[m]
        if kind == "cublas":
            def run():
                for w in self.weights:
                    torch.mm(x, w.t())
        else:
            def run():
                with contextlib.nullcontext() if kind == "gemv" else second_launch_reductions():
                    for w in self.weights:
                        gemv(x, w, config=config)
        return graph_us(run, len(self.weights))


def compare(name: str) -> None:
    print(f"\n{name} ({DTYPE}): µs per matmul (GB/s of W + x + y)")
    print("(gemv: the engine's one launch; gemv 2-launch: split-K summed by a second kernel, the tests' oracle)")
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


def _step_us(step, repeats: int) -> float:
    """Median µs of the decode step's graph (a fresh capture each time: the block choice may have changed)."""
    return statistics.median(1000 * graph_ms(step.run) for _ in range(repeats))


def _time_choices(step, key: tuple[int, int, int], choices) -> list[tuple[float, GemvConfig]]:
    """(step µs, choice) for each choice of one shape, fastest first; choices this GPU cannot run are skipped."""
    results = []
    for cfg in choices:
        GEMV_TABLE[key] = cfg
        gemv_config.cache_clear()
        try:
            results.append((_step_us(step, 1), cfg))
        except Exception as err:  # noqa: BLE001 - e.g. more shared memory than the GPU has
            print(f"{'':>10} skipped {cfg}: {type(err).__name__}")
    return sorted(results, key=lambda r: r[0])


def in_situ(context: int, rounds: int, min_gain_us: float = 5.0) -> None:
    """Coordinate descent over the Qwen3-0.6B shapes on the whole batch-1 decode step (see the module doc).
    Per shape: `candidates` (tile, K step, split), then around the best of them K step x warps x stages;
    the three fastest are re-timed (3 captures each) against the current choice, which is replaced only
    when it loses by more than `min_gain_us` per step (captures differ by ~1-2 µs, and smaller gains did
    not carry over to the engine)."""
    print(f"\nin situ: the batch-1 Qwen3-0.6B decode step (context {context}, PDL on, one CUDA graph), µs per step")

    def fmt(c: GemvConfig) -> str:
        return f"{c.block_n}x{c.block_k} split {c.split_k} warps {c.num_warps} stages {c.num_stages}"

    before = dict(GEMV_TABLE)
    with torch.inference_mode(), pdl_launches(True):
        step = DecodeStep(1, context)
        start = _step_us(step, 3)
        print(f"start: {start:.1f} µs")
        for round_ in range(rounds):
            for proj, (n, k, _) in model_shapes("qwen3").items():
                key = (n, k, 2)
                listed, current = key in GEMV_TABLE, gemv_config(n, k, 2)
                found = _time_choices(step, key, candidates(n, k))
                near = {dataclasses.replace(found[0][1], block_k=bk, num_warps=w, num_stages=st)
                        for bk in (64, 128, 256) for w in (4, 8) for st in (3, 4, 5)}
                found = sorted(found + _time_choices(step, key, near - {c for _, c in found}), key=lambda r: r[0])
                GEMV_TABLE[key] = current
                gemv_config.cache_clear()
                reference = _step_us(step, 3)
                confirmed = [(reference, current)]
                for _, cfg in found[:3]:
                    if cfg != current:
                        GEMV_TABLE[key] = cfg
                        gemv_config.cache_clear()
                        confirmed.append((_step_us(step, 3), cfg))
                best_us, best = min(confirmed, key=lambda r: r[0])
                keep = best_us >= reference - min_gain_us
                GEMV_TABLE[key] = current if keep else best
                if keep and not listed:  # the heuristic's choice stays the heuristic's (no entry)
                    del GEMV_TABLE[key]
                gemv_config.cache_clear()
                print(f"round {round_ + 1} {proj:>8} {n}x{k}: {fmt(current)} {reference:.1f} µs -> "
                      f"{'kept' if keep else f'{fmt(best)} {best_us:.1f} µs'}")
        final = _step_us(step, 5)
    print(f"step: {start:.1f} -> {final:.1f} µs. GEMV_TABLE (kernels/gemv.py):")
    for (n, k, size), cfg in GEMV_TABLE.items():
        print(f"    ({n}, {k}, {size}): {cfg!r},{'' if before.get((n, k, size)) == cfg else '  # new'}")
    GEMV_TABLE.clear()
    GEMV_TABLE.update(before)
    gemv_config.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--sweep", action="store_true", help="also time block choices per shape")
    parser.add_argument("--sweep-only", action="store_true", help="the sweep without the cuBLAS comparison")
    parser.add_argument("--in-situ", action="store_true",
                        help="choose Qwen3-0.6B's blocks on the whole batch-1 decode step (only this)")
    parser.add_argument("--context", type=int, default=1024, help="--in-situ: tokens per sequence")
    parser.add_argument("--rounds", type=int, default=2, help="--in-situ: passes over the shapes")
    args = parser.parse_args()
    if args.in_situ:
        print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
        in_situ(args.context, args.rounds)
        return
    names = list(MODELS) if args.model == "all" else [args.model]
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for name in names if not args.sweep_only else []:
        compare(name)
    if args.sweep or args.sweep_only:
        for name in names:
            sweep(name)


if __name__ == "__main__":
    main()
