"""GPU benchmark: one decode step's draw by sampling mode, the torch top-k path against the Triton kernel.

Why: Qwen3's generation_config (temperature 0.6, top_k 20, top_p 0.95) must cost about what plain temperature
sampling costs (issue 42: `workload.top_k=20` ran 9 % below `workload.top_p=1` on an H200 nano bench, where
a step of 256 rows lasts ~9 ms, so 3 % is ~270 µs). Rows: [rows, 151936] logits, N(0, 0.64^2) (the scale of
`model.load_format=dummy`) or x5 (peaked, closer to a trained model), bf16 and float32. Columns, µs per
draw (CUDA events, median of --reps):

- eager: `Sampler.sample_on_device` (key packing and copy, every launch, the host's Python in between)
- graph: one CUDA graph replay of `sample_uniform` over static keys (what the sampler graphs do; plain and
  top-k only; top-p alone and min_p are never graphed)
- torch: the previous top-k path, `sampler._sample_top_k` (torch.topk, a dozen launches, two copies)
- kernel: `kernels.top_k_sample.top_k_sample` alone

min_p is `logits_processors.apply_min_p` over every row, then the plain draw. Every top-k row must draw the
same token on the torch path and the kernel, ties included (bf16 logits tie often, at the k-th rank and at
the nucleus cut): each row that does not is printed as a MISMATCH line with the reference's token
(`reference.top_k_sample_reference`) and its ties, and the bench exits non-zero after its table. CUDA only:

    python launch/bench/bench_sampler.py [--rows 256] [--reps 50] [--peaked]
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
from spmd_engine.executor.logits_processors import apply_min_p
from spmd_engine.executor.sampler import Sampler, SamplingBatch, _sample_top_k, sample_uniform
from spmd_engine.kernels.reference import top_k_sample_reference
from spmd_engine.kernels.top_k_sample import k_cap_for, make_scratch, top_k_sample
from tests.helpers.graph_capture import capture

VOCAB = 151_936
MODES = {  # name: (temperature, top_p, top_k, min_p)
    "plain": (0.6, 1.0, -1, 0.0),
    "top_p 0.95": (0.6, 0.95, -1, 0.0),
    "top_k 20": (0.6, 1.0, 20, 0.0),
    "top_k 20 + top_p 0.95": (0.6, 0.95, 20, 0.0),
    "min_p 0.05": (0.6, 1.0, -1, 0.05),
}


def timed(fn, reps: int) -> float:
    """Median µs of `fn` on the GPU (events around each call, after a warm-up)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def keys(batch: SamplingBatch) -> dict[str, torch.Tensor]:
    dev = torch.device("cuda")
    return dict(temperatures=torch.tensor(batch.temperatures, dtype=torch.float32, device=dev),
                seeds=torch.tensor(batch.seeds, device=dev), counters=torch.tensor(batch.counters, device=dev),
                top_k=torch.tensor(batch.top_k, device=dev), top_p=torch.tensor(batch.top_p, device=dev))


def tied_at_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    values = logits.float().topk(k + 1, dim=-1).values
    return values[:, k - 1] == values[:, k]


def mismatches(name: str, logits: torch.Tensor, args: tuple, old: torch.Tensor, new: torch.Tensor, k: int) -> list[str]:
    """One line per row where the torch path and the kernel draw different tokens (at most 8), with the
    reference's token of that row (which side is off) and its ties (at the k-th rank, inside the top-k)."""
    rows = torch.nonzero(old != new).flatten().tolist()
    ranked = logits.float().topk(k + 1, dim=-1).values
    lines = []
    for row in rows[:8]:
        ref = top_k_sample_reference(*(t[row:row + 1] for t in args))[0].item()
        inside = int((ranked[row, 1:k] == ranked[row, :k - 1]).sum())
        tied = bool(ranked[row, k - 1] == ranked[row, k])
        lines.append(f"  MISMATCH {name}: row {row}: torch {old[row].item()}, kernel {new[row].item()}, "
                     f"reference {ref}; tied at rank k: {tied}, tied pairs inside the top-k: {inside}")
    if len(rows) > 8:
        lines.append(f"  MISMATCH {name}: {len(rows)} rows in all: {rows}")
    return lines


def bench_mode(name: str, logits: torch.Tensor, reps: int) -> tuple[str, list[str]]:
    """The mode's line of the table, and its MISMATCH lines (top-k modes)."""
    rows = logits.shape[0]
    temp, top_p, top_k, min_p = MODES[name]
    rng = np.random.default_rng(0)
    batch = SamplingBatch(rng.integers(-2**63, 2**63 - 1, rows, dtype=np.int64), np.full(rows, 7, dtype=np.int64),
                          np.full(rows, temp), np.full(rows, top_p), np.full(rows, top_k, dtype=np.int64))
    sampler = Sampler(logits.device)
    if min_p:
        margins = [float(np.log(min_p) * temp)] * rows
        work = logits.clone()

        def eager():
            work.copy_(logits)
            apply_min_p(work, list(range(rows)), margins)
            return sampler.sample_on_device(work, batch)
        copy_only = timed(lambda: work.copy_(logits), reps)
        return f"{name:24s} eager {timed(eager, reps) - copy_only:9.1f}", []
    line = f"{name:24s} eager {timed(lambda: sampler.sample_on_device(logits, batch), reps):9.1f}"
    k = keys(batch)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    differ: list[str] = []
    if top_k > 0:
        scratch = make_scratch(rows, logits.shape[1], 32, logits.device)
        graph, _ = capture(lambda: sample_uniform("top_k", logits, k["temperatures"], k["seeds"], k["counters"], out,
                                               k["top_k"], k["top_p"], scratch))
        args = (logits, k["temperatures"], k["top_k"], k["top_p"], k["seeds"], k["counters"])

        def torch_path():
            return _sample_top_k(logits.float(), k["temperatures"], batch.top_k.tolist(), batch.top_p.tolist(),
                                 k["seeds"], k["counters"])
        old = torch_path()
        new = top_k_sample(*args, k_cap_for(top_k))
        ties = tied_at_k(logits, top_k)
        line += (f"  graph {timed(graph.replay, reps):9.1f}  torch {timed(torch_path, reps):9.1f}"
                 f"  kernel {timed(lambda: top_k_sample(*args, k_cap_for(top_k), out, scratch), reps):9.1f}"
                 f"  same tokens: {int((old == new).sum())}/{rows} ({int(ties.sum())} rows tied at rank k)")
        differ = mismatches(f"{name} {str(logits.dtype).removeprefix('torch.')}", logits, args, old, new, top_k)
    elif top_p >= 1.0:
        graph, _ = capture(lambda: sample_uniform("plain", logits, k["temperatures"], k["seeds"], k["counters"], out))
        line += f"  graph {timed(graph.replay, reps):9.1f}"
    return line, differ


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[256])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--peaked", action="store_true", help="logits x5 (a trained model's sharper rows)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sampler.py needs a CUDA GPU")
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}; vocab {VOCAB}, T 0.6; µs per draw (median)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    found = []
    for rows in args.rows:
        base = torch.randn(rows, VOCAB, device="cuda", generator=gen) * 0.64 * (5 if args.peaked else 1)
        for dtype in (torch.bfloat16, torch.float32):
            logits = base.to(dtype)
            print(f"## {rows} rows, {str(dtype).removeprefix('torch.')} logits")
            for name in MODES:
                line, differ = bench_mode(name, logits, args.reps)
                print(line, flush=True)
                found += differ
    if found:
        print("\n".join(found))
        raise SystemExit("the top-k kernel and the torch path drew different tokens (see MISMATCH above)")


if __name__ == "__main__":
    main()
