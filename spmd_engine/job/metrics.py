"""Job metrics: throughput, TTFT and ITL statistics, KV capacity, written to metrics.json."""
from __future__ import annotations

import json
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


def summarize(outputs: list[RequestOutput], wall_time_s: float) -> dict:
    """Aggregate statistics of one generate call."""
    ok = [o for o in outputs if o.finish_reason != "error"]
    prompt_tokens = sum(len(o.prompt_token_ids or []) for o in ok)
    output_tokens = sum(len(o.token_ids) for o in ok)
    ttft = [o.first_token_time for o in ok if o.first_token_time is not None]
    itl = [b - a for o in ok for a, b in zip(o.token_times, o.token_times[1:])]
    return {
        "num_requests": len(outputs),
        "num_errors": len(outputs) - len(ok),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in ok),
        "wall_time_s": wall_time_s,
        "output_tokens_per_s": output_tokens / wall_time_s if wall_time_s > 0 else 0.0,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / wall_time_s if wall_time_s > 0 else 0.0,
        "ttft": distribution(ttft),
        "itl": distribution(itl),
        "kv_demand_tokens": kv_demand_tokens(ok),
    }


def kv_demand_tokens(outputs: list[RequestOutput]) -> int:
    """KV tokens every request would hold at its longest (prompt + output) if all ran at once.

    Why: compared with kv_capacity.tokens it says whether a job could have kept every request
    resident; above 1x the scheduler must queue or preempt, which is what a capacity sweep shows.
    """
    return sum(len(o.prompt_token_ids or []) + len(o.token_ids) for o in outputs)


def write_metrics(path: Path, metrics: dict) -> None:
    Path(path).write_text(json.dumps(metrics, indent=2, default=str) + "\n", encoding="utf-8")
