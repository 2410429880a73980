"""metrics.json of a resumed job: the earlier runs' figures kept beside this run's, and the job's totals.

Why: a resumed run computes only the requests without a row, so its own figures describe part of the
job (152 of 200 requests), and a resume of a finished job runs nothing: writing only this run's
figures lost the rest. The earlier metrics.json is read before it is replaced and kept, run by run,
under `previous_runs`; `job_totals` sums the request and token counts over every run with figures.
"""
from __future__ import annotations

import json
from pathlib import Path

TOTAL_KEYS = ("num_requests", "num_errors", "prompt_tokens", "output_tokens")
_NOT_KEPT = ("config", "previous_runs", "job_totals", "resumed")  # each run's config is the job's; no nesting


def earlier_runs(path: Path) -> list[dict]:
    """The runs an existing metrics.json describes, oldest first ([] without one, or unreadable)."""
    try:
        earlier = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(earlier, dict):
        return []
    previous = [run for run in earlier.get("previous_runs", []) if isinstance(run, dict)]
    return previous + [{k: v for k, v in earlier.items() if k not in _NOT_KEPT}]


def with_earlier_runs(metrics: dict, previous: list[dict]) -> dict:
    """`metrics` of this resumed run, marked resumed, with `previous_runs` and the job's totals."""
    runs = [*previous, metrics]
    totals = {key: sum(run.get(key, 0) or 0 for run in runs) for key in TOTAL_KEYS}
    totals["runs"] = len(runs)
    totals["note"] = "summed over every run that wrote metrics.json (each run's own figures: previous_runs, then this)"
    return {**metrics, "resumed": True, "previous_runs": previous, "job_totals": totals}
