"""Can the plain draw hide under the LM head? Serial against vocabulary chunks on two streams, CUDA graphs.

Why: at the bench's ~129 rows the LM head (float32 logits, ~105 us) reads its 311 MB of weights at
bandwidth while the Gumbel race after it (~50 us) is bound by instructions, not bytes. Cut into vocabulary
chunks, the race of chunk i could run on a second stream beside the GEMM of chunk i + 1. This times one
graph replay of each form (Qwen3-0.6B's LM head: vocabulary 151,936, hidden 1,024, bf16; the padding rows
at temperature 0, as the sampler graphs give them): the LM head alone, the race alone, both one after the
other, and 2-8 chunks with the race beside the next GEMM ("overlap") or after it ("serial"). A timing
probe: each chunk races on its own, so its tokens are not the draw's. H200, 144 rows: head + race 152.6 µs,
2 chunks overlapped 162.1: the chunked GEMMs cost more than the race they would hide. CUDA only:

    python launch/bench/bench_lm_head_race.py [--rows 144:129 256:241 64:60] [--chunks 2 3 4 6 8]
"""
from __future__ import annotations

import argparse

import torch

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
from spmd_engine.kernels.sampling_noise import RACE_CHUNK, gumbel_race

VOCAB, HIDDEN, TEMPERATURE = 151936, 1024, 0.6


def replay_us(graph: torch.cuda.CUDAGraph, reps: int = 200) -> float:
    """Best of three timed loops of `reps` replays, µs per replay."""
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / reps)
    return best


def captured_us(fn) -> float:
    fn()  # warm-up outside the capture: compiles, and makes the race's scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_us(graph)


def probe(weight: torch.Tensor, rows: int, real: int, chunk_counts: list[int]) -> dict[str, float]:
    dev = weight.device
    hidden = torch.randn(rows, HIDDEN, device=dev, dtype=torch.bfloat16)
    temps = torch.full((rows,), TEMPERATURE, device=dev)
    temps[real:] = 0.0
    seeds = torch.arange(rows, device=dev, dtype=torch.int64)
    counters = torch.arange(rows, device=dev, dtype=torch.int64) * 7
    logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    tokens = torch.zeros(rows, device=dev, dtype=torch.int64)

    def head_then_race():
        gumbel_race(torch.mm(hidden, weight.t(), out_dtype=torch.float32), temps, seeds, counters, out=tokens)

    times = {"LM head": captured_us(lambda: torch.mm(hidden, weight.t(), out_dtype=torch.float32)),
             "race": captured_us(lambda: gumbel_race(logits, temps, seeds, counters, out=tokens)),
             "head + race": captured_us(head_then_race)}
    side = torch.cuda.Stream()
    for count in chunk_counts:
        width = -(-VOCAB // count)
        width = -(-width // RACE_CHUNK) * RACE_CHUNK  # whole race chunks
        bounds = [(lo, min(VOCAB, lo + width)) for lo in range(0, VOCAB, width)]

        def chunked(overlap: bool, bounds=bounds) -> None:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            for lo, hi in bounds:
                part = torch.mm(hidden, weight[lo:hi].t(), out_dtype=torch.float32)
                if overlap:
                    ready = torch.cuda.Event()
                    ready.record(main)
                    side.wait_event(ready)
                    with torch.cuda.stream(side):
                        gumbel_race(part, temps, seeds, counters, out=tokens)
                else:
                    gumbel_race(part, temps, seeds, counters, out=tokens)
            main.wait_stream(side)

        times[f"{len(bounds)} chunks overlap"] = captured_us(lambda: chunked(True))
        times[f"{len(bounds)} chunks serial"] = captured_us(lambda: chunked(False))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=["144:129", "256:241", "64:60"],
                        help="graph rows:real rows (the rest are padding at temperature 0)")
    parser.add_argument("--chunks", nargs="+", type=int, default=[2, 3, 4, 6, 8])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_lm_head_race: needs a CUDA GPU")
    torch.manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; µs per graph replay")
    for spec in args.rows:
        rows, real = (int(v) for v in spec.split(":"))
        times = probe(weight, rows, real, args.chunks)
        print(f"{rows} rows ({real} real): " + ", ".join(f"{name} {us:.1f}" for name, us in times.items()))


if __name__ == "__main__":
    main()
