"""GPU benchmark: the top-p draw (`nucleus_sample`) launch by launch, against the plain draw, by tile choice.

Why: the engine's default sampling (top_p 0.95) must stay within 3 % of plain temperature sampling, and at
129-256 rows its chunked rounds after the first cost more than their work: most programs of those launches
belong to rows already decided and return at once, while a rejected row's programs each race 4,096 columns.
This prints each launch's mean GPU time (torch.profiler over repeated draws) for the tiles (columns per
iteration, warps) of `NUCLEUS_MASS_TILE` (round 0's mass pass) and `NUCLEUS_ROUND_TILE` (the later rounds),
and how many tokens differ from the default tiles' draw (a tile only reorders the float sums inside a chunk,
so a difference can only come from a row at its nucleus boundary).

Logits: N(0, 0.64^2) float32 at Qwen3's vocabulary, the scale of `model.load_format=dummy` (hidden 1,024,
weights N(0, 0.02)), and a peaked variant (x 5) closer to a trained model's. CUDA only:

    python launch/bench/bench_nucleus.py [--rows 129 256] [--reps 30] [--tiles 1024/4 2048/8]
"""
from __future__ import annotations

import argparse
import collections

import torch

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
import spmd_engine.kernels.sampling_noise as sn

VOCAB = 151_936
TILES = [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16)]


def launch_times(fn, reps: int) -> tuple[dict[str, float], float]:
    """Mean GPU µs per call of each kernel `fn` launches, and their sum."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = collections.defaultdict(float)
    for e in prof.key_averages():  # GPU activity only: every key is a kernel, copy or memset
        times[e.key] += getattr(e, "self_device_time_total", 0.0) / reps
    times = {k: v for k, v in times.items() if v > 0}
    return times, sum(times.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[129, 256])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--tiles", nargs="+", default=[f"{b}/{w}" for b, w in TILES], metavar="COLUMNS/WARPS",
                        help="the tiles to try for each of the two passes")
    args = parser.parse_args()
    tiles = [tuple(int(v) for v in t.split("/")) for t in args.tiles]
    if not torch.cuda.is_available():
        raise SystemExit("bench_nucleus.py needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    default = (sn.NUCLEUS_MASS_TILE, sn.NUCLEUS_ROUND_TILE)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}; vocab {VOCAB}, T 0.6, top_p 0.95; "
          "µs per draw (mean of the launches' GPU time)")
    for rows in args.rows:
        for scale_name, scale in (("dummy", 0.64), ("peaked", 3.2)):
            logits = torch.randn(rows, VOCAB, device="cuda", generator=gen) * scale
            temps = torch.full((rows,), 0.6, device="cuda")
            top_ps = torch.full((rows,), 0.95, device="cuda")
            seeds = torch.randint(0, 2**62, (rows,), device="cuda", generator=gen)
            counters = torch.randint(0, 1000, (rows,), device="cuda", generator=gen)
            _, plain = launch_times(lambda: sn.gumbel_race(logits, temps, seeds, counters), args.reps)
            print(f"--- {rows} rows, {scale_name} logits: plain race {plain:.1f} µs")
            sn.NUCLEUS_MASS_TILE, sn.NUCLEUS_ROUND_TILE = default
            reference = sn.nucleus_sample(logits, temps, top_ps, seeds, counters, 6)
            configs = [("mass", t) for t in tiles] + [("round", t) for t in tiles if t != default[1]]
            for which, tile in configs:
                sn.NUCLEUS_MASS_TILE, sn.NUCLEUS_ROUND_TILE = ((tile, default[1]) if which == "mass"
                                                               else (default[0], tile))
                times, total = launch_times(lambda: sn.nucleus_sample(logits, temps, top_ps, seeds, counters, 6),
                                            args.reps)
                differ = int((sn.nucleus_sample(logits, temps, top_ps, seeds, counters, 6) != reference).sum())
                parts = ", ".join(f"{k.lstrip('_').replace('_kernel', '')} {v:.1f}"
                                  for k, v in sorted(times.items(), key=lambda kv: -kv[1]))
                print(f"  {which} tile {tile[0]}/{tile[1]}w: {total:6.1f} µs (+{total - plain:.1f} over plain), "
                      f"{differ} tokens differ | {parts}", flush=True)
            sn.NUCLEUS_MASS_TILE, sn.NUCLEUS_ROUND_TILE = default


if __name__ == "__main__":
    main()
