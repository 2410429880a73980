"""Job metrics: throughput, TTFT and ITL statistics, KV capacity, written to metrics.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from spmd_engine.core.requests import RequestOutput


def distribution(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    a = np.asarray(values, dtype=np.float64) * 1000.0
    return {"count": int(a.size), "mean_ms": float(a.mean()), "p50_ms": float(np.percentile(a, 50)),
            "p90_ms": float(np.percentile(a, 90)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max())}


SAMPLE_CAP = 1_000_000  # TTFT / ITL values kept per replica; past it a uniform sample (Algorithm R)


@dataclass
class RunningStats:
    """What `summarize` reports, gathered one finished request at a time (a job holds no outputs), and
    mergeable across replicas. Counts and sums are exact; the TTFT / ITL percentiles are exact up to
    SAMPLE_CAP values and drawn from a uniform sample of them beyond."""

    num_requests: int = 0
    num_completions: int = 0  # rows: a request of sampling.n = k has k (an error row is one)
    num_errors: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_prompt_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    ttft_seen: int = 0
    itl_seen: int = 0

    def add(self, out: RequestOutput) -> None:
        first = not out.sample_index  # a request's prompt is counted once, with its first completion
        self.num_requests += first
        self.num_completions += 1
        if out.finish_reason == "error":
            self.num_errors += 1
            return
        self.prompt_tokens += len(out.prompt_token_ids or []) if first else 0
        self.output_tokens += len(out.token_ids)
        self.cached_prompt_tokens += out.num_cached_tokens
        if out.first_token_time is not None:
            self.ttft_seen = _sample_into(self.ttft, self.ttft_seen, [out.first_token_time])
        times = out.token_times
        self.itl_seen = _sample_into(self.itl, self.itl_seen, [b - a for a, b in zip(times, times[1:])])

    def merge(self, other: dict) -> None:
        """Add another replica's `vars(RunningStats)`."""
        for key in ("num_requests", "num_completions", "num_errors", "prompt_tokens", "output_tokens",
                    "cached_prompt_tokens"):
            setattr(self, key, getattr(self, key) + other[key])
        self.ttft_seen = (_sample_into(self.ttft, self.ttft_seen, other["ttft"])
                          - len(other["ttft"]) + other["ttft_seen"])
        self.itl_seen = _sample_into(self.itl, self.itl_seen, other["itl"]) - len(other["itl"]) + other["itl_seen"]

    def summary(self, wall_time_s: float) -> dict:
        tokens = self.prompt_tokens + self.output_tokens
        return {
            "num_requests": self.num_requests,
            "num_completions": self.num_completions,
            "num_errors": self.num_errors,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "wall_time_s": wall_time_s,
            "output_tokens_per_s": self.output_tokens / wall_time_s if wall_time_s > 0 else 0.0,
            "total_tokens_per_s": tokens / wall_time_s if wall_time_s > 0 else 0.0,
            "ttft": distribution(self.ttft),
            "itl": distribution(self.itl),
            "kv_demand_tokens": tokens,  # see kv_demand_tokens
        }


def _sample_into(kept: list[float], seen: int, values: list[float], cap: int = SAMPLE_CAP) -> int:
    """Reservoir sampling (Algorithm R, the slot of the n-th value a fixed hash of n: reproducible, and
    the same sample however the values are split into calls or merged); returns the new count."""
    if len(kept) + len(values) <= cap:  # below the cap every value is kept: one extend per request
        kept.extend(values)
        return seen + len(values)
    room = cap - len(kept)
    if room > 0:
        kept.extend(values[:room])
        seen += room
        values = values[room:]
    if len(values):
        slots = _reservoir_slots(seen, len(values))
        hits = np.flatnonzero(slots < cap)
        for i, slot in zip(hits.tolist(), slots[hits].tolist()):  # in order: a later value wins a slot
            kept[slot] = values[i]
    return seen + len(values)


def _reservoir_slots(first: int, count: int) -> np.ndarray:
    """Algorithm R's draw for the values numbered first .. first + count - 1: value n goes to a slot
    uniform in [0, n] (kept if below the cap), from a splitmix64 hash of n. Vectorised: a seeded
    `random.Random` per value cost ~5 us, ~2.6 ms per finished request of 500 tokens past the cap,
    on rank 0's step path."""
    n = np.arange(first, first + count, dtype=np.uint64)
    z = n + np.uint64(0x9E3779B97F4A7C15)  # uint64 arrays wrap silently
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z % (n + np.uint64(1))).astype(np.int64)


def summarize(outputs: list[RequestOutput], wall_time_s: float) -> dict:
    """Aggregate statistics of one generate call."""
    stats = RunningStats()
    for out in outputs:
        stats.add(out)
    return stats.summary(wall_time_s)


def kv_demand_tokens(outputs: list[RequestOutput]) -> int:
    """KV tokens every request would hold at its longest (prompt + output) if all ran at once.

    Why: compared with kv_capacity.tokens it says whether a job could have kept every request
    resident; above 1x the scheduler must queue or preempt, which is what a capacity sweep shows.
    """
    return sum(len(o.prompt_token_ids or []) + len(o.token_ids) for o in outputs)


def write_metrics(path: Path, metrics: dict) -> None:
    Path(path).write_text(json.dumps(metrics, indent=2, default=str) + "\n", encoding="utf-8")


SUMMED_ENGINE_KEYS = ("steps", "decode_steps", "preemptions", "cached_prompt_tokens", "sampler_graph_steps",
                      "unique_prompt_tokens", "prompt_tokens_computed")


def replicas_engine(runs: list[dict]) -> dict:
    """metrics.json's `engine` for a job of len(runs) data-parallel replicas (`Engine.last_run` of each
    replica's leader, in replica order): one replica's as is; with several, the counts summed, the step
    timing merged over every replica's steps (`merge_step_timing`) and each replica's own under
    `per_replica`.

    Why: with dp > 1 replica 0's figures alone read as the job's (half the steps at dp=2)."""
    if len(runs) == 1:
        return runs[0]
    out: dict = {"data_parallel_size": len(runs),
                 "aggregation": "counts summed over replicas; step_timing: step-weighted means over every "
                                "replica's steps; each replica's own figures under per_replica"}
    for key in SUMMED_ENGINE_KEYS:
        out[key] = sum(run.get(key, 0) for run in runs)
    out["async_scheduling"] = runs[0].get("async_scheduling")
    out["step_timing"] = merge_step_timing([run.get("step_timing", {"steps": 0}) for run in runs])
    out["per_replica"] = [{"replica": r, **run} for r, run in enumerate(runs)]
    return out


def merge_step_timing(summaries: list[dict]) -> dict:
    """Several `StepTimer.summary()`s as one over all their steps: per step kind, the steps and launches
    summed and the per-step means weighted by steps (exact for means; the p50 is not mergeable and is
    left out); `decode_max_batch` merges only the replicas whose largest decode batch is the largest."""
    out: dict = {"steps": sum(s.get("steps", 0) for s in summaries)}
    kinds = [k for s in summaries for k in s if k != "steps"]
    for kind in dict.fromkeys(kinds):
        rows = [s[kind] for s in summaries if kind in s]
        if kind == "decode_max_batch":
            top = max(row["mean_seqs"] for row in rows)
            rows = [row for row in rows if row["mean_seqs"] == top]
        out[kind] = _merge_timing_rows(rows)
    return out


def _merge_timing_rows(rows: list[dict]) -> dict:
    steps = sum(row["steps"] for row in rows)
    merged: dict = {"steps": steps}
    means = [k for row in rows for k in row if k.endswith("_ms") and k != "step_p50_ms"] + ["mean_seqs", "mean_tokens"]
    for key in dict.fromkeys(means):
        known = [row for row in rows if key in row]
        weight = sum(row["steps"] for row in known)
        if known and weight:
            merged[key] = sum(row[key] * row["steps"] for row in known) / weight
    step_total = sum(row["step_ms"] * row["steps"] for row in rows)
    merged["host_plan_fraction"] = (sum(row["host_plan_ms"] * row["steps"] for row in rows) / step_total
                                    if step_total > 0 else 0.0)
    idle = [row for row in rows if "gpu_idle_ms" in row]
    idle_step = sum(row["step_ms"] * row["steps"] for row in idle)
    if idle and idle_step > 0:
        merged["gpu_idle_fraction"] = sum(row["gpu_idle_ms"] * row["steps"] for row in idle) / idle_step
    launches: dict[str, int] = {}
    for row in rows:
        for kind, n in row.get("launches", {}).items():
            launches[kind] = launches.get(kind, 0) + n
    if launches:
        merged["launches"] = launches
    return merged
