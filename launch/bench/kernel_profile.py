"""GPU time per decode step by kernel, measured by difference (CUDA only).

Why: a profile over a whole `generate` mixes the prefill and mixed steps into every kernel's mean, so
a per-call average says little about a decode step. This runs the same requests twice with two output
lengths under torch.profiler and divides the difference of each kernel's GPU time by the extra decode
steps: what one decode step of that batch and context costs, kernel by kernel. The same two calls timed
without the profiler give the step's wall time: above the kernels' sum is what runs between them.

    python launch/bench/kernel_profile.py                         # Qwen3-0.6B dummy weights, batch 1 and 256
    python launch/bench/kernel_profile.py --model qwen3 --batch 64 --context 2000 --set kv_cache_dtype=fp8
    python launch/bench/kernel_profile.py --whole-bench           # kernel totals over the nano-vllm bench run
    python launch/bench/kernel_profile.py --batch 129 --top-p 1 0.95   # the default nucleus against plain temperature
    python launch/bench/kernel_profile.py --prefill-steps 5       # 8,190-token prefill steps (both: prefix cache off)
    python launch/bench/kernel_profile.py --boundary              # the bench's GPU timeline between decode steps
"""
from __future__ import annotations

import argparse

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)


def kernel_times(engine, requests) -> dict[str, tuple[float, int]]:
    """GPU microseconds and call count per kernel name over one generate call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(requests)
        torch.cuda.synchronize()
    return {e.key: (getattr(e, "self_device_time_total", 0.0), e.count) for e in prof.key_averages()}


def wall_seconds(engine, requests) -> float:
    """Wall time of one generate call, no profiler (it stretches the host side)."""
    import time

    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(requests)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def per_step(engine, batch: int, context: int, short: int, long: int, top: int, top_p: float = 1.0) -> None:
    from spmd_engine.job.workloads import bench_requests

    def requests(out: int):
        return bench_requests({"num_seqs": batch, "min_input_len": context, "max_input_len": context,
                               "min_output_len": out, "max_output_len": out, "top_p": top_p})

    engine.generate(requests(4))  # compile and warm every kernel of this shape first
    a, b = kernel_times(engine, requests(short)), kernel_times(engine, requests(long))
    steps = long - short
    # the step's wall time by the same difference: above the kernels' sum is what runs between them
    # (launch gaps inside the graph, the host when it is behind)
    wall_ms = min(wall_seconds(engine, requests(long)) - wall_seconds(engine, requests(short)) for _ in range(2))
    wall_ms *= 1e3 / steps
    rows = [((b[k][0] - a.get(k, (0.0, 0))[0]) / steps, (b[k][1] - a.get(k, (0.0, 0))[1]) / steps, k) for k in b]
    kernels_ms = sum(r[0] for r in rows) / 1e3
    print(f"--- batch {batch}, context {context + short}..{context + long}, top_p {top_p:g}: GPU per decode step "
          f"{kernels_ms:.3f} ms (difference of {steps} steps); wall per decode step {wall_ms:.3f} ms "
          f"({wall_ms - kernels_ms:+.3f} ms beside the kernels)")
    for us, calls, name in sorted(rows, reverse=True)[:top]:
        print(f"{us:9.1f} us {calls:6.1f} calls/step {us / max(calls, 1e-9):8.2f} us/call  {name[:90]}")


def table(engine, requests, units: int, unit: str, top: int) -> None:
    """Kernel GPU time over one generate call (after an unprofiled one), per `unit` (`units` of them)."""
    engine.generate(requests)
    rows = sorted(((us, calls, name) for name, (us, calls) in kernel_times(engine, requests).items()), reverse=True)
    print(f"--- GPU kernels {sum(r[0] for r in rows) / units / 1e3:.3f} ms per {unit}")
    for us, calls, name in rows[:top]:
        print(f"{us / units:10.1f} us {calls / units:7.1f} calls {us / max(calls, 1):8.1f} us/call  {name[:90]}")


def boundary(engine, requests, show: int = 3) -> None:
    """What the GPU runs between a decode step's forward and the next one's: one bench run under the
    profiler (kernels, copies and memsets in start order), the gaps between consecutive ones by size, and a
    few decode-step boundaries around their draw (`_gumbel_race_kernel`), each op with the gap before it."""
    import collections
    import json
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    engine.generate(requests)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(requests)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    ops = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(ops, ops[1:])]
    print(f"--- {len(ops)} GPU ops over {(ops[-1]['ts'] + ops[-1]['dur'] - ops[0]['ts']) / 1e3:.1f} ms, busy "
          f"{sum(e['dur'] for e in ops) / 1e3:.1f} ms; gaps between consecutive ops (negative: overlapping streams)")
    edges = [-1e9, 0, 1, 2, 5, 10, 30, 100, 1000, 1e9]
    counts = collections.Counter(next(i for i in range(len(edges) - 1) if edges[i] <= g < edges[i + 1]) for g in gaps)
    for i in range(len(edges) - 1):
        total = sum(g for g in gaps if edges[i] <= g < edges[i + 1]) / 1e3
        print(f"  [{edges[i]:g}, {edges[i + 1]:g}) us: {counts[i]:7d} gaps, {total:8.1f} ms")
    draws = [i for i, e in enumerate(ops) if e["name"].startswith("_gumbel_race")]
    for at in draws[len(draws) // 2: len(draws) // 2 + show]:
        print(f"--- a decode step's boundary (op {at}): gap before, duration, op")
        for j in range(max(at - 3, 1), min(at + 12, len(ops))):
            e = ops[j]
            print(f"  {gaps[j - 1]:8.2f} {e['dur']:8.2f} us  {e.get('cat'):10s} {e['name'][:80]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3", help="a conf/model group (dummy weights)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    p.add_argument("--context", type=int, default=600, help="prompt tokens per request")
    p.add_argument("--steps", type=int, nargs=2, default=[16, 48], metavar=("SHORT", "LONG"),
                   help="the two output lengths")
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--top-p", type=float, nargs="+", default=[1.0], metavar="P",
                   help="the requests' top_p (the bench's workload.top_p), one profile each; 1: plain temperature")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an engine key (yaml value; dotted keys nest: debug.cuda_pdl=false)")
    p.add_argument("--whole-bench", action="store_true", help="instead: kernel totals over the bench workload")
    p.add_argument("--boundary", action="store_true",
                   help="instead: the bench's GPU timeline between decode steps (gaps, copies, the draw)")
    p.add_argument("--prefill-steps", type=int, default=0, metavar="N",
                   help="instead: N pure prefill steps of 15 distinct 546-token prompts (8,190 tokens) each")
    args = p.parse_args()

    import yaml

    from spmd_engine.config import engine_config_from_dict
    from spmd_engine.distributed import RankInfo
    from spmd_engine.engine import Engine
    from spmd_engine.llm import compose_config

    keys = {"max_model_len": 4096, "log_level": "WARNING"}
    if args.whole_bench or args.prefill_steps or args.boundary:  # the profiled run repeats the warm one: no hits
        keys["enable_prefix_caching"] = False
    for key, value in (s.split("=", 1) for s in args.set):  # a dotted key (debug.cuda_pdl) sets a nested one
        *groups, name = key.split(".")
        node = keys
        for group in groups:
            node = node.setdefault(group, {})
        node[name] = yaml.safe_load(value)
    raw = compose_config(args.model, keys)
    raw["model"]["load_format"] = "dummy"
    engine = Engine(engine_config_from_dict(raw), RankInfo(0, 1, 0, "127.0.0.1", 0, "single"))
    try:
        from spmd_engine.job.workloads import bench_requests

        if args.whole_bench:
            for top_p in args.top_p:
                table(engine, bench_requests({"top_p": top_p}), 1, f"bench run (top_p {top_p:g})", args.top)
        if args.boundary:
            boundary(engine, bench_requests({"top_p": args.top_p[0]}))
        if args.prefill_steps:
            n = 15 * args.prefill_steps
            prompts = bench_requests({"num_seqs": n, "min_input_len": 546, "max_input_len": 546, "min_output_len": 1,
                                      "max_output_len": 1, "random_seed": 99})
            table(engine, prompts, args.prefill_steps, "8,190-token prefill step", args.top)
        for batch in [] if args.whole_bench or args.prefill_steps or args.boundary else args.batch:
            for top_p in args.top_p:
                per_step(engine, batch, args.context, args.steps[0], args.steps[1], args.top, top_p)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
