"""Host time per engine step on CPU: rank 0's real step loop with the model and the GPU left out.

Why: on an H200 a decode step of 256 sequences takes ~6.3 ms of GPU time and async scheduling
overlaps the host's work with it, so once rank 0's Python (schedule, plan, staging, sampling launch,
postprocess, finishing requests, outputs.jsonl rows) takes as long per step, the job is host-bound.
This runs that host path as the job runs it, on CPU, so it can be measured and profiled anywhere:
`StepLoop` with the real Scheduler, PlanBuilder, BlockTableMirror, build_host_batch and input
buffers (padded like the decode graphs / piecewise buckets), the real Sampler over a small
vocabulary, postprocess and finishing, and the job's row sink writing outputs.jsonl into a temp dir.
Only the forward is fake: it returns a cached logits tensor.

    python launch/bench/host_step_bench.py                     # the 2048-request bench (~1 min on 2 cores)
    python launch/bench/host_step_bench.py --profile           # plus a cProfile top-20 by cumulative time
    python launch/bench/host_step_bench.py --repo /tmp/wt980   # another checkout's engine (before/after)
    python launch/bench/host_step_bench.py --clock thread      # phases in the loop thread's CPU time (a busy machine)

Prints the mean host ms per phase (`last_run['step_timing']`) per step kind, and the sha256 of the
finalized outputs.jsonl (equal across two trees = the same rows, byte for byte).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import importlib.util
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

PHASES = ("postprocess", "schedule", "broadcast", "inputs", "sample", "forward")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", default=str(Path(__file__).resolve().parents[2]),
                   help="checkout whose spmd_engine to run (default: this one)")
    p.add_argument("--num-seqs", type=int, default=2048, help="requests (the steady-state bench: 2048)")
    p.add_argument("--min-input-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=100)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--vocab", type=int, default=512, help="logits columns (small: the sampler's math stays cheap)")
    p.add_argument("--temperature", type=float, default=0.6, help="the bench's; 0 = greedy")
    p.add_argument("--profile", action="store_true", help="print a cProfile top-20 (cumulative) of the loop")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="what the phases count: wall time (as the engine does), or the loop thread's CPU time "
                        "(time.thread_time: time spent descheduled on a shared machine is left out)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    sys.path.insert(0, args.repo)
    import numpy as np
    import torch

    import spmd_engine
    import spmd_engine.engine as engine_module
    from spmd_engine.step_loop import GenerateCall, LoopParts, StepLoop
    from spmd_engine.config import EngineConfig, ModelConfig, WorkloadConfig
    from spmd_engine.core.plan import StepPlan
    from spmd_engine.core.sequence import SamplingParams
    from spmd_engine.executor.block_table import BlockTableMirror
    from spmd_engine.executor.cuda_graphs import graph_batch_sizes, smallest_holding
    from spmd_engine.executor.forward_batch import build_host_batch
    from spmd_engine.executor.input_buffers import InputBuffers
    from spmd_engine.executor.piecewise_graphs import piecewise_token_buckets
    from spmd_engine.faults.progress import StepProgress
    from spmd_engine.job.outputs import OutputsWriter
    from spmd_engine.job.workloads import bench_requests

    torch.set_num_threads(1)
    print(f"engine: {Path(spmd_engine.__file__).resolve().parent}  clock: {args.clock}")
    if args.clock == "thread":  # the phases' clock only (spmd_engine.telemetry.step_timing.PhaseClock)
        import spmd_engine.telemetry.step_timing as step_timing
        step_timing.time = SimpleNamespace(**{**{k: getattr(time, k) for k in dir(time) if not k.startswith("__")},
                                              "perf_counter": time.thread_time})
    max_blocks = -(-args.max_model_len // args.block_size)
    num_blocks = args.max_num_seqs * max_blocks  # every sequence at full length at once: no preemption
    eos = args.vocab - 1

    class CachedLogitsRunner:
        """ModelRunner's rank-0 host work without a model: the plan's tables, host batch and input
        buffers as on CUDA (decode steps padded to a graph size, others to a piecewise bucket); the
        forward returns the first rows of one cached logits tensor."""

        def __init__(self) -> None:
            self.num_blocks = num_blocks
            self.mirror = BlockTableMirror(max_blocks, args.block_size)
            self.inputs = InputBuffers(max(args.max_num_batched_tokens, args.max_num_seqs), args.max_num_seqs,
                                       max_blocks, args.block_size, torch.device("cpu"))
            self.graph_sizes = graph_batch_sizes(args.max_num_seqs)
            self.buckets = piecewise_token_buckets(args.max_num_batched_tokens)
            self.logits = torch.randn(args.max_num_seqs, args.vocab, generator=torch.Generator().manual_seed(0))
            self.last_prompt_logits = None
            self.sampler_graphs = None  # as on CPU: every step samples eagerly

        def stage(self, plan: StepPlan) -> SimpleNamespace:
            host = build_host_batch(plan, self.mirror.apply(plan), args.block_size)
            if host.is_decode:
                self.inputs.load(host, rows=smallest_holding(self.graph_sizes, host.num_seqs))
                kind = "decode_graph"
            else:
                self.inputs.load(host, pad_tokens=smallest_holding(self.buckets, host.num_tokens))
                kind = "piecewise_graph"
            return SimpleNamespace(plan=plan, launch_kind=kind)

        def apply_stop(self, plan: StepPlan) -> None:
            self.mirror.apply(plan)

        def launch(self, staged, prev_tokens):
            rows = int(staged.plan.sample.sum())
            return self.logits[:rows].clone() if rows else None

        def sampler_graph_rows(self, staged) -> None:
            return None  # no sampler graphs, as on CPU: every step samples eagerly

    cfg = EngineConfig(model=ModelConfig("fake", None, "dummy", {}), workload=WorkloadConfig("bench"),
                       sampling=SamplingParams(), block_size=args.block_size, num_kv_blocks=num_blocks,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_model_len, device="cpu")
    params = {"num_seqs": args.num_seqs, "min_input_len": args.min_input_len, "max_input_len": args.max_input_len,
              "min_output_len": args.min_output_len, "max_output_len": args.max_output_len,
              "temperature": args.temperature}  # prompt ids up to the bench's token_id_max (10000)
    cfg.workload.params = params
    requests = bench_requests(params)
    runner = CachedLogitsRunner()
    scheduler = engine_module.new_scheduler(cfg, args.max_model_len, num_blocks, [eos])
    replica = SimpleNamespace(broadcast_object=lambda plan: plan)
    parts = LoopParts(cfg, scheduler, runner, replica, StepProgress(), torch.device("cpu"), 151936,
                      args.max_model_len)
    gc.freeze()  # as Engine does: the block manager's bookkeeping stays out of the collector's passes

    out_dir = Path(tempfile.mkdtemp(prefix="host_step_bench_"))
    path = out_dir / "outputs.jsonl"
    bar = SimpleNamespace(update=lambda n=1: None, close=lambda: None)
    if importlib.util.find_spec("spmd_engine.job.feed") is not None:  # the lazy feed and the job's row sink
        from spmd_engine.job.feed import CHUNK_REQUESTS, RequestFeed
        from spmd_engine.job.hydra_job import _RowSink
        feed = RequestFeed(cfg, None, iter(requests), len(requests), CHUNK_REQUESTS)
        writer = OutputsWriter(path, sampling_of=feed.sampling_of)
        source, on_finish = feed, _RowSink(writer, bar, None).output
    else:  # before it (980c7c0): every request admitted up front, rows written by the writer
        sampling = {r.index: {**vars(cfg.sampling), **r.overrides} for r in requests}
        writer = OutputsWriter(path, sampling_of=sampling.get)
        source, on_finish = requests, writer.write
    generation = StepLoop(parts, GenerateCall.of(source, on_finish), 0)

    profiler = cProfile.Profile() if args.profile else None
    started = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    outputs = generation.run()
    if profiler is not None:
        profiler.disable()
    wall = time.perf_counter() - started
    writer.close()
    writer.finalize()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    report(generation.summary, outputs, wall, digest, np)
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(20)
        print(text.getvalue())
    path.unlink()
    out_dir.rmdir()


def report(summary: dict, outputs: list, wall: float, digest: str, np) -> None:
    """Mean host ms per phase, per step kind; the run's totals; the outputs' digest."""
    timing = summary["step_timing"]
    tokens = sum(len(o.token_ids) for o in outputs)
    print(f"{len(outputs)} requests, {tokens} output tokens, {timing['steps']} steps in {wall:.1f} s "
          f"({wall / max(1, timing['steps']) * 1e3:.2f} ms per step)")
    print(f"{'kind':<8} {'steps':>6} {'seqs':>6} {'tokens':>7} " + " ".join(f"{p:>11}" for p in PHASES)
          + f" {'host sum':>9}")
    for kind in ("decode", "mixed", "prefill"):
        row = timing.get(kind)
        if row is None:
            continue
        values = [row[f"{p}_ms"] for p in PHASES]
        print(f"{kind:<8} {row['steps']:>6} {row['mean_seqs']:>6.0f} {row['mean_tokens']:>7.0f} "
              + " ".join(f"{v:>11.3f}" for v in values) + f" {sum(values):>9.3f}")
    print(f"outputs.jsonl sha256 {digest}")


if __name__ == "__main__":
    main()
