"""Job metrics: throughput, TTFT and ITL statistics, KV capacity, written to metrics.json."""
from __future__ import annotations

import json
import random
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
    num_errors: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_prompt_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    ttft_seen: int = 0
    itl_seen: int = 0

    def add(self, out: RequestOutput) -> None:
        self.num_requests += 1
        if out.finish_reason == "error":
            self.num_errors += 1
            return
        self.prompt_tokens += len(out.prompt_token_ids or [])
        self.output_tokens += len(out.token_ids)
        self.cached_prompt_tokens += out.num_cached_tokens
        if out.first_token_time is not None:
            self.ttft_seen = _sample_into(self.ttft, self.ttft_seen, [out.first_token_time])
        times = out.token_times
        self.itl_seen = _sample_into(self.itl, self.itl_seen, [b - a for a, b in zip(times, times[1:])])

    def merge(self, other: dict) -> None:
        """Add another replica's `vars(RunningStats)`."""
        for key in ("num_requests", "num_errors", "prompt_tokens", "output_tokens", "cached_prompt_tokens"):
            setattr(self, key, getattr(self, key) + other[key])
        self.ttft_seen = _sample_into(self.ttft, self.ttft_seen, other["ttft"]) - len(other["ttft"]) + other["ttft_seen"]
        self.itl_seen = _sample_into(self.itl, self.itl_seen, other["itl"]) - len(other["itl"]) + other["itl_seen"]

    def summary(self, wall_time_s: float) -> dict:
        tokens = self.prompt_tokens + self.output_tokens
        return {
            "num_requests": self.num_requests,
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
    """Reservoir sampling (Algorithm R, a fixed seed per count: reproducible); returns the new count."""
    if len(kept) + len(values) <= cap:  # below the cap every value is kept: one extend per request
        kept.extend(values)
        return seen + len(values)
    for value in values:
        if len(kept) < cap:
            kept.append(value)
        else:
            slot = random.Random(seen).randrange(seen + 1)
            if slot < cap:
                kept[slot] = value
        seen += 1
    return seen


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
