#!/usr/bin/env python3
"""Summarize a Hydra multirun of run.py: one table row per job and a throughput plot (sweep.png).

Standalone on purpose (no spmd_engine import): it reads only the files a sweep leaves behind,
so it runs on a login node or a laptop after copying the multirun directory.

    python launch/sweep_report.py multirun/2026-01-01/12-00-00
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

PLOT_NAME = "sweep.png"
COLUMNS = ("job", "block_size", "gpu_mem_util", "status", "out tok/s", "TTFT p50 ms", "ITL p50 ms",
           "KV blocks", "error")
ERROR_WIDTH = 80


@dataclass(frozen=True)
class SweepPoint:
    """What one job of the sweep produced, flattened from its metrics.json and Hydra config."""
    job: str
    block_size: int | None
    gpu_memory_utilization: float | None
    status: str  # ok | failed | missing (no metrics.json: the job died before writing it)
    output_tokens_per_s: float | None
    ttft_p50_ms: float | None
    itl_p50_ms: float | None
    kv_blocks: int | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _natural_key(path: Path) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.as_posix())]


def find_job_dirs(multirun_dir: Path) -> list[Path]:
    """Every directory below `multirun_dir` that holds a job: a metrics.json or a .hydra/ record."""
    multirun_dir = Path(multirun_dir)
    dirs = {p.parent for p in multirun_dir.rglob("metrics.json")}
    dirs |= {p.parent.parent for p in multirun_dir.rglob(".hydra/overrides.yaml")}
    dirs.discard(multirun_dir)  # a single (non-multirun) job dir passed by mistake is not a sweep point
    return sorted(dirs, key=lambda p: _natural_key(p.relative_to(multirun_dir)))


def _read_yaml(path: Path) -> Any:
    if not path.is_file():
        return None
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _override_values(overrides: list[str]) -> dict[str, str]:
    values = {}
    for item in overrides or []:
        key, sep, value = str(item).lstrip("+~").partition("=")
        if sep:
            values[key] = value
    return values


def _number(value: Any, kind: type) -> Any:
    if value is None or value == "null":
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        return None


def _p50(metrics: dict, key: str) -> float | None:
    dist = metrics.get(key)
    return _number(dist.get("p50_ms"), float) if isinstance(dist, dict) else None


def load_point(job_dir: Path, name: str) -> SweepPoint:
    """One job's row; the job's own overrides win over its recorded config (they should agree)."""
    job_dir = Path(job_dir)
    metrics_path = job_dir / "metrics.json"
    metrics: dict = json.loads(metrics_path.read_text(encoding="utf-8")) if metrics_path.is_file() else {}
    config = metrics.get("config") or _read_yaml(job_dir / ".hydra" / "config.yaml") or {}
    overrides = _read_yaml(job_dir / ".hydra" / "overrides.yaml") or metrics.get("overrides") or []
    chosen = {**{k: config.get(k) for k in ("block_size", "gpu_memory_utilization")}, **_override_values(overrides)}
    kv = metrics.get("kv_capacity")
    status = str(metrics.get("status", "failed")) if metrics else "missing"
    error = metrics.get("error") or (None if metrics else "no metrics.json (job did not finish)")
    return SweepPoint(
        job=name,
        block_size=_number(chosen.get("block_size"), int),
        gpu_memory_utilization=_number(chosen.get("gpu_memory_utilization"), float),
        status=status,
        output_tokens_per_s=_number(metrics.get("output_tokens_per_s"), float) if status == "ok" else None,
        ttft_p50_ms=_p50(metrics, "ttft"),
        itl_p50_ms=_p50(metrics, "itl"),
        kv_blocks=_number(kv.get("blocks"), int) if isinstance(kv, dict) else None,
        error=None if error is None else str(error),
    )


def load_sweep(multirun_dir: Path) -> list[SweepPoint]:
    multirun_dir = Path(multirun_dir)
    return [load_point(d, d.relative_to(multirun_dir).as_posix()) for d in find_job_dirs(multirun_dir)]


def _cell(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table_rows(points: list[SweepPoint]) -> list[tuple[str, ...]]:
    """The table's cells as strings, one tuple per point, in COLUMNS order."""
    rows = []
    for p in points:
        error = (p.error or "").replace("\n", " ")
        if len(error) > ERROR_WIDTH:
            error = error[: ERROR_WIDTH - 3] + "..."
        rows.append((p.job, _cell(p.block_size), _cell(p.gpu_memory_utilization, 2), p.status,
                     _cell(p.output_tokens_per_s), _cell(p.ttft_p50_ms), _cell(p.itl_p50_ms, 2),
                     _cell(p.kv_blocks), error or "-"))
    return rows


def format_table(points: list[SweepPoint]) -> str:
    rows = [COLUMNS, *table_rows(points)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_sweep(points: list[SweepPoint], png_path: Path) -> bool:
    """Throughput vs block_size, one line per gpu_memory_utilization, failed points as red x at 0.

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    utils = sorted({p.gpu_memory_utilization for p in points}, key=lambda u: (u is None, u or 0.0))
    for util in utils:
        mine = sorted((p for p in points if p.gpu_memory_utilization == util and p.block_size is not None),
                      key=lambda p: p.block_size)
        good = [p for p in mine if p.ok and p.output_tokens_per_s is not None]
        label = f"gpu_memory_utilization={util}" if util is not None else "gpu_memory_utilization=?"
        line, = ax.plot([p.block_size for p in good], [p.output_tokens_per_s for p in good], "o-", label=label)
        bad = [p for p in mine if not p.ok]
        if bad:
            ax.plot([p.block_size for p in bad], [0.0] * len(bad), "x", color="red", markersize=10, mew=2,
                    label=f"failed ({label})")
    sizes = sorted({p.block_size for p in points if p.block_size is not None})
    if sizes and all(s > 0 for s in sizes):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("block_size (tokens per KV block)")
    ax.set_ylabel("output tokens / s")
    failed = sum(not p.ok for p in points)
    ax.set_title(f"{len(points)} jobs, {failed} failed" if failed else f"{len(points)} jobs")
    ax.grid(True, alpha=0.3)
    if utils:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("multirun_dir", type=Path, help="hydra.sweep.dir of a `python run.py -m ...` sweep")
    parser.add_argument("--no-plot", action="store_true", help=f"skip writing {PLOT_NAME}")
    args = parser.parse_args(argv)
    if not args.multirun_dir.is_dir():
        print(f"error: multirun_dir {args.multirun_dir} is not a directory", file=sys.stderr)
        return 2
    points = load_sweep(args.multirun_dir)
    if not points:
        print(f"error: no job directories (metrics.json or .hydra/) under {args.multirun_dir}", file=sys.stderr)
        return 2
    print(format_table(points))
    ok = [p for p in points if p.ok and p.output_tokens_per_s is not None and not math.isnan(p.output_tokens_per_s)]
    if ok:
        best = max(ok, key=lambda p: p.output_tokens_per_s)
        print(f"\nbest: job {best.job} (block_size={best.block_size}, gpu_memory_utilization="
              f"{best.gpu_memory_utilization}) at {best.output_tokens_per_s:.1f} output tok/s")
    if not args.no_plot:
        png = args.multirun_dir / PLOT_NAME
        if plot_sweep(points, png):
            print(f"plot: {png}")
        else:
            print("note: matplotlib is not installed (pip install matplotlib); skipped the plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
