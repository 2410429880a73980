#!/usr/bin/env python3
"""Summarize a Hydra multirun of run.py: a row per job, a row per point (repeats grouped), a verdict, sweep.png.

Standalone on purpose (no spmd_engine import): it reads only the files a sweep leaves behind
(each job's metrics.json, written by rank 0, and Hydra's .hydra/overrides.yaml), so it runs on a
login node or a laptop after copying the multirun directory, for plain, torchrun and slurm sweeps.

    python launch/sweep_report.py multirun/2026-01-01/12-00-00 [--sort=-out_tok_s] [--best-by ttft_p99_ms]

Swept keys are the overrides whose value differs between jobs. Jobs that differ only by a repeat
key (`+repeat=0,1,2`; see --repeat-key) are one point: its cells are the median and half the
spread (spread = max - min over the repeats). A point is named best only when its median beats the
runner-up's by more than the larger spread of the two; otherwise the report says which points are
indistinguishable. Without repeats it says it cannot tell noise from effect.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

PLOT_NAME = "sweep.png"
ERROR_WIDTH = 80
DEFAULT_REPEAT_KEYS = ("repeat",)
MIN_REPEATS = 2  # a spread needs two runs


def _get(metrics: dict, *path: str) -> Any:
    value: Any = metrics
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _float(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(out) else out


def _demand_ratio(metrics: dict) -> float | None:
    demand, tokens = _float(metrics.get("kv_demand_tokens")), _float(_get(metrics, "kv_capacity", "tokens"))
    return demand / tokens if demand is not None and tokens else None


@dataclass(frozen=True)
class Metric:
    """One numeric column: how to read it from metrics.json and which direction is better."""
    name: str  # column header; also the name --sort and --best-by take
    title: str  # plot panel title
    read: Callable[[dict], float | None]
    digits: int
    higher_is_better: bool
    needs_ok: bool = False  # only meaningful when the job finished (a failed job's 0 tok/s is no datum)


def _path(*path: str) -> Callable[[dict], float | None]:
    return lambda metrics: _float(_get(metrics, *path))


METRICS: tuple[Metric, ...] = (
    Metric("kv_tokens", "KV capacity (tokens)", _path("kv_capacity", "tokens"), 0, True),
    Metric("kv_blocks", "KV capacity (blocks)", _path("kv_capacity", "blocks"), 0, True),
    Metric("demand_x", "KV demand / capacity", _demand_ratio, 2, False),
    Metric("preempt", "preemptions", _path("engine", "preemptions"), 0, False),
    Metric("out_tok_s", "output tok/s", _path("output_tokens_per_s"), 1, True, needs_ok=True),
    Metric("ttft_p50_ms", "TTFT p50 (ms)", _path("ttft", "p50_ms"), 1, False),
    Metric("ttft_p99_ms", "TTFT p99 (ms)", _path("ttft", "p99_ms"), 1, False),
    Metric("itl_p50_ms", "ITL p50 (ms)", _path("itl", "p50_ms"), 2, False),
    Metric("itl_p99_ms", "ITL p99 (ms)", _path("itl", "p99_ms"), 2, False),
    Metric("peak_gib", "peak GPU memory (GiB)", _path("peak_gpu_memory_gib"), 2, False),
)
METRIC_BY_NAME = {m.name: m for m in METRICS}
PLOT_METRICS = ("out_tok_s", "ttft_p99_ms", "preempt", "kv_tokens")


@dataclass(frozen=True)
class JobResult:
    """What one job of the sweep produced: its overrides, status and metric values (rank 0's)."""
    job: str
    params: dict[str, str]  # every override of the job, key (without +/~) -> value as written
    status: str  # ok | failed | missing (no metrics.json: the job died before writing it)
    error: str | None
    values: dict[str, float | None]  # Metric.name -> value

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _natural_key(text: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def find_job_dirs(multirun_dir: Path) -> list[Path]:
    """Every directory below `multirun_dir` that holds a job: a metrics.json or a .hydra/ record."""
    multirun_dir = Path(multirun_dir)
    dirs = {p.parent for p in multirun_dir.rglob("metrics.json")}
    dirs |= {p.parent.parent for p in multirun_dir.rglob(".hydra/overrides.yaml")}
    dirs.discard(multirun_dir)  # a single (non-multirun) job dir passed by mistake is not a sweep point
    return sorted(dirs, key=lambda p: _natural_key(p.relative_to(multirun_dir).as_posix()))


def _read_yaml(path: Path) -> Any:
    if not path.is_file():
        return None
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def override_values(overrides: list[str] | None) -> dict[str, str]:
    """`["+repeat=1", "block_size=16"]` -> {"repeat": "1", "block_size": "16"} (hydra.* keys left out)."""
    values = {}
    for item in overrides or []:
        key, sep, value = str(item).lstrip("+~").partition("=")
        if sep and not key.startswith(("hydra.", "hydra/")):
            values[key] = value
    return values


def load_job(job_dir: Path, name: str) -> JobResult:
    """One job's row; Hydra's record of the job's overrides wins over the copy in metrics.json."""
    job_dir = Path(job_dir)
    metrics_path = job_dir / "metrics.json"
    metrics: dict = json.loads(metrics_path.read_text(encoding="utf-8")) if metrics_path.is_file() else {}
    overrides = _read_yaml(job_dir / ".hydra" / "overrides.yaml") or metrics.get("overrides") or []
    status = str(metrics.get("status", "failed")) if metrics else "missing"
    error = metrics.get("error") or (None if metrics else "no metrics.json (job did not finish)")
    values = {m.name: (m.read(metrics) if status == "ok" or not m.needs_ok else None) for m in METRICS}
    return JobResult(name, override_values(overrides), status, None if error is None else str(error), values)


def load_sweep(multirun_dir: Path) -> list[JobResult]:
    multirun_dir = Path(multirun_dir)
    return [load_job(d, d.relative_to(multirun_dir).as_posix()) for d in find_job_dirs(multirun_dir)]


def swept_keys(jobs: list[JobResult], repeat_keys: tuple[str, ...] = DEFAULT_REPEAT_KEYS) -> list[str]:
    """Keys whose value differs between jobs (repeat keys aside), in the order the jobs name them."""
    order: list[str] = []
    for job in jobs:
        order += [k for k in job.params if k not in order]
    return [k for k in order if k not in repeat_keys and len({j.params.get(k) for j in jobs}) > 1]


def _value_key(value: str | None) -> tuple:
    """Sort order of override values: missing last, numbers by value, then text."""
    if value is None:
        return (2, 0.0, "")
    number = _float(value)
    return (0, number, "") if number is not None else (1, 0.0, value)


@dataclass(frozen=True)
class Stat:
    """A metric over a point's repeats that finished with a value."""
    median: float
    low: float
    high: float
    n: int

    @property
    def spread(self) -> float:
        return self.high - self.low


@dataclass(frozen=True)
class Point:
    """The jobs of one configuration: equal in every swept key, different only by repeat keys."""
    keys: tuple[str, ...]
    values: tuple[str | None, ...]
    jobs: tuple[JobResult, ...]

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in zip(self.keys, self.values)) or "all jobs"

    @property
    def num_ok(self) -> int:
        return sum(j.ok for j in self.jobs)

    def value(self, key: str) -> str | None:
        return self.values[self.keys.index(key)]

    def stat(self, metric: str) -> Stat | None:
        got = [j.values[metric] for j in self.jobs if j.ok and j.values.get(metric) is not None]
        if not got:
            return None
        return Stat(float(statistics.median(got)), min(got), max(got), len(got))


def group_points(jobs: list[JobResult], keys: list[str]) -> list[Point]:
    """One Point per distinct combination of the swept keys, in the order of the keys' values."""
    groups: dict[tuple, list[JobResult]] = {}
    for job in jobs:
        groups.setdefault(tuple(job.params.get(k) for k in keys), []).append(job)
    ordered = sorted(groups, key=lambda vals: [_value_key(v) for v in vals])
    return [Point(tuple(keys), vals, tuple(groups[vals])) for vals in ordered]


@dataclass(frozen=True)
class Verdict:
    """Which point is best by one metric, or why none can be named."""
    kind: str  # best | indistinguishable | no_repeats | single | none
    metric: str
    leader: Point | None  # the best median
    runner_up: Point | None
    tied: tuple[Point, ...]  # points that cannot be told from the leader, leader first
    margin: float | None  # |leader median - runner-up median|
    spread: float | None  # max(leader spread, runner-up spread)
    text: str


def _fmt(value: float, digits: int) -> str:
    return f"{value:,.{digits}f}"


def judge(points: list[Point], metric_name: str, repeat_hint: str = "+repeat=0,1,2") -> Verdict:
    """Name the best point by `metric_name` only if it beats the runner-up by more than the spread."""
    metric = METRIC_BY_NAME[metric_name]
    rated = [(p, p.stat(metric.name)) for p in points]
    rated = [(p, s) for p, s in rated if s is not None]
    if not rated:
        return Verdict("none", metric.name, None, None, (), None, None,
                       f"verdict ({metric.name}): no point has a {metric.name} value")
    rated.sort(key=lambda ps: -ps[1].median if metric.higher_is_better else ps[1].median)
    (leader, lead), digits = rated[0], metric.digits
    direction = "highest" if metric.higher_is_better else "lowest"
    if len(rated) == 1:
        return Verdict("single", metric.name, leader, None, (leader,), None, None,
                       f"verdict ({metric.name}): one point only ({leader.label}); nothing to compare")
    runner, second = rated[1]
    margin = abs(lead.median - second.median)
    if lead.n < MIN_REPEATS or second.n < MIN_REPEATS:
        few = leader if lead.n < MIN_REPEATS else runner
        return Verdict("no_repeats", metric.name, leader, runner, (), margin, None,
                       f"verdict ({metric.name}): cannot tell noise from effect: {few.label} has "
                       f"{min(lead.n, second.n)} finished run; rerun with {repeat_hint} "
                       f"(the {direction} is {leader.label} at {_fmt(lead.median, digits)})")
    spread = max(lead.spread, second.spread)
    if margin > spread:
        return Verdict("best", metric.name, leader, runner, (leader,), margin, spread,
                       f"best ({metric.name}): {leader.label} at {_fmt(lead.median, digits)} (median of "
                       f"{lead.n}), beats the runner-up {runner.label} ({_fmt(second.median, digits)}) by "
                       f"{_fmt(margin, digits)}, more than the spread of their repeats ({_fmt(spread, digits)})")
    tied = tuple(p for p, s in rated if abs(lead.median - s.median) <= max(lead.spread, s.spread))
    others = len(rated) - len(tied)
    tail = (f"; the other {others} point(s) are worse by more than the spread" if others else "")
    return Verdict("indistinguishable", metric.name, leader, runner, tied, margin, spread,
                   f"indistinguishable ({metric.name}): {', '.join(p.label for p in tied)}: the "
                   f"{direction} median beats the runner-up by {_fmt(margin, digits)}, not more than the "
                   f"spread of their repeats ({_fmt(spread, digits)}){tail}")


# --- tables ------------------------------------------------------------------------------
def _cell(value: float | None, digits: int) -> str:
    return "-" if value is None else _fmt(value, digits)


def _stat_cell(stat: Stat | None, digits: int) -> str:
    if stat is None:
        return "-"
    if stat.n < MIN_REPEATS:
        return _fmt(stat.median, digits)
    return f"{_fmt(stat.median, digits)} ±{_fmt(stat.spread / 2, digits)}"


def _error_cell(error: str | None) -> str:
    error = (error or "").replace("\n", " ")
    if len(error) > ERROR_WIDTH:
        error = error[: ERROR_WIDTH - 3] + "..."
    return error or "-"


def job_columns(keys: list[str], repeat_keys: list[str]) -> list[str]:
    return ["job", *keys, *repeat_keys, "status", *(m.name for m in METRICS), "error"]


def point_columns(keys: list[str]) -> list[str]:
    return ["point", *keys, "runs", *(m.name for m in METRICS)]


def job_rows(jobs: list[JobResult], keys: list[str], repeat_keys: list[str]) -> list[tuple[str, ...]]:
    """The job table's cells, one tuple per job, in job_columns order."""
    return [(j.job, *(j.params.get(k, "-") for k in keys), *(j.params.get(k, "-") for k in repeat_keys),
             j.status, *(_cell(j.values.get(m.name), m.digits) for m in METRICS), _error_cell(j.error))
            for j in jobs]


def point_rows(points: list[Point]) -> list[tuple[str, ...]]:
    """The point table's cells: median ±half the spread of each metric over the point's repeats."""
    rows = []
    for i, p in enumerate(points):
        failed = len(p.jobs) - p.num_ok
        runs = f"{p.num_ok}/{len(p.jobs)} ok"
        rows.append((str(i), *(v if v is not None else "-" for v in p.values),
                     runs if not failed else f"{runs} ({failed} not)",
                     *(_stat_cell(p.stat(m.name), m.digits) for m in METRICS)))
    return rows


def format_table(header: list[str], rows: list[tuple[str, ...]]) -> str:
    table = [tuple(header), *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown(header: list[str], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


class SortError(ValueError):
    """--sort names no column."""


def _parse_sort(spec: str, columns: list[str]) -> tuple[str, bool]:
    descending = spec.startswith("-")
    name = spec.lstrip("-")
    if name not in columns:
        raise SortError(f"--sort {spec}: no column {name!r}; columns: {', '.join(columns)}")
    return name, descending


def _ordered(items: list, key: Callable[[Any], Any], descending: bool) -> list:
    """Sort by key (None = missing, always last); ties keep their order."""
    present = [x for x in items if key(x) is not None]
    missing = [x for x in items if key(x) is None]
    return sorted(present, key=key, reverse=descending) + missing


def sort_jobs(jobs: list[JobResult], spec: str, keys: list[str], repeat_keys: list[str]) -> list[JobResult]:
    """Jobs ordered by one column of the job table; "-COL" for descending."""
    name, desc = _parse_sort(spec, job_columns(keys, repeat_keys))
    if name in METRIC_BY_NAME:
        return _ordered(jobs, lambda j: j.values.get(name), desc)
    if name == "job":
        return _ordered(jobs, lambda j: _natural_key(j.job), desc)
    if name in ("status", "error"):
        return _ordered(jobs, lambda j: getattr(j, name) or "", desc)
    return _ordered(jobs, lambda j: None if j.params.get(name) is None else _value_key(j.params.get(name)), desc)


def sort_points(points: list[Point], spec: str, job_only: tuple[str, ...] = ("job", "status", "error")) -> list[Point]:
    """Points ordered by one column of the point table (a metric by its median); "-COL" for descending.
    A column only the job table has (`job_only`, e.g. the repeat key) leaves the points in order."""
    keys = list(points[0].keys) if points else []
    name, desc = _parse_sort(spec, point_columns(keys) + list(job_only))
    if name in METRIC_BY_NAME:
        def median(p: Point) -> float | None:
            stat = p.stat(name)
            return None if stat is None else stat.median
        return _ordered(points, median, desc)
    if name in keys:
        return _ordered(points, lambda p: None if p.value(name) is None else _value_key(p.value(name)), desc)
    if name in ("runs", "status"):
        return _ordered(points, lambda p: p.num_ok, desc)
    return list(points)  # point / job / error: the natural order


# --- plot --------------------------------------------------------------------------------
def plot_sweep(points: list[Point], png_path: Path) -> bool:
    """Small panels: a row per metric (throughput, TTFT p99, preemptions, KV capacity), a column per
    swept key; a line per combination of the other keys; medians with min..max error bars from the
    repeats, y from zero; points without a finished run as red x at 0.

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    keys = list(points[0].keys) if points else []
    columns = keys or [None]
    fig, axes = plt.subplots(len(PLOT_METRICS), len(columns), figsize=(3.6 * len(columns) + 0.6, 9.6),
                             squeeze=False)
    for col, key in enumerate(columns):
        xs = sorted({p.value(key) for p in points}, key=_value_key) if key else [None]
        others = [k for k in keys if k != key]
        series: dict[tuple, list[Point]] = {}
        for p in points:
            series.setdefault(tuple(p.value(k) for k in others), []).append(p)
        for row, name in enumerate(PLOT_METRICS):
            metric, ax = METRIC_BY_NAME[name], axes[row][col]
            for combo, mine in series.items():
                label = " ".join(f"{k}={v}" for k, v in zip(others, combo)) or None
                pos, med, lo, hi, bad = [], [], [], [], []
                for p in mine:
                    x = xs.index(p.value(key)) if key else 0
                    stat = p.stat(name)
                    if stat is None:
                        if p.num_ok == 0:
                            bad.append(x)
                        continue
                    pos.append(x)
                    med.append(stat.median)
                    lo.append(stat.median - stat.low)
                    hi.append(stat.high - stat.median)
                if pos:
                    order = sorted(range(len(pos)), key=pos.__getitem__)
                    ax.errorbar([pos[i] for i in order], [med[i] for i in order],
                                yerr=[[lo[i] for i in order], [hi[i] for i in order]],
                                fmt="o-", capsize=3, markersize=4, label=label)
                if bad:
                    ax.plot(bad, [0.0] * len(bad), "x", color="red", markersize=9, mew=2,
                            label=f"no finished run{f' ({label})' if label else ''}")
            top = ax.get_ylim()[1]
            ax.set_ylim(0, top * 1.08 if top > 0 else 1.0)  # from zero: a 3 % effect must look like one
            ax.set_xticks(range(len(xs)), [str(x) if x is not None else "-" for x in xs] if key else ["all"])
            ax.set_xlim(-0.5, len(xs) - 0.5)
            ax.grid(True, alpha=0.3)
            ax.set_title(metric.title, fontsize=9)
            ax.tick_params(labelsize=8)
            if row == len(PLOT_METRICS) - 1:
                ax.set_xlabel(key or "")
        if axes[0][col].get_legend_handles_labels()[1]:
            axes[0][col].legend(fontsize=7)
    repeats = sorted({len(p.jobs) for p in points})
    failed = sum(len(p.jobs) - p.num_ok for p in points)
    fig.suptitle(f"{sum(len(p.jobs) for p in points)} jobs, {len(points)} points, "
                 f"{'/'.join(map(str, repeats))} run(s) per point" + (f", {failed} not ok" if failed else "")
                 + "; error bars: min..max of the repeats", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return True


# --- main --------------------------------------------------------------------------------
def report(jobs: list[JobResult], repeat_keys: tuple[str, ...], sort: str | None, best_by: str,
           markdown: bool = False) -> tuple[str, list[Point], Verdict]:
    """The text the command prints: fixed overrides, the job table, the point table, the verdict."""
    keys = swept_keys(jobs, repeat_keys)
    repeats_seen = [k for k in repeat_keys if any(k in j.params for j in jobs)]
    points = group_points(jobs, keys)
    table = format_markdown if markdown else format_table
    shown_jobs, shown_points = jobs, points
    if sort:
        shown_jobs = sort_jobs(jobs, sort, keys, repeats_seen)
        shown_points = sort_points(points, sort, ("job", "status", "error", *repeats_seen))
    fixed = {k: v for k, v in jobs[0].params.items() if k not in keys and k not in repeat_keys
             and all(j.params.get(k) == v for j in jobs)}
    parts = []
    if fixed:
        parts.append("fixed: " + " ".join(f"{k}={v}" for k, v in fixed.items()))
    parts.append(f"swept: {', '.join(keys) or '(nothing)'}"
                 + (f"; repeats: {', '.join(repeats_seen)}" if repeats_seen else "; no repeat key"))
    parts.append("\njobs (rank 0's metrics.json each):\n"
                 + table(job_columns(keys, repeats_seen), job_rows(shown_jobs, keys, repeats_seen)))
    if any(len(p.jobs) > 1 for p in points):
        parts.append("\npoints (median ±half the spread; spread = max - min over the repeats):\n"
                     + table(point_columns(keys), point_rows(shown_points)))
    hint = f"+{repeat_keys[0]}=0,1,2" if repeat_keys else "+repeat=0,1,2"
    verdict = judge(points, best_by, hint)
    parts.append("\n" + verdict.text)
    return "\n".join(parts), points, verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("multirun_dir", type=Path, help="hydra.sweep.dir of a `python run.py -m ...` sweep")
    parser.add_argument("--sort", metavar="COL", help="sort both tables by a column (e.g. out_tok_s, "
                        "ttft_p99_ms, block_size); -COL for descending: --sort=-out_tok_s")
    parser.add_argument("--best-by", default="out_tok_s", choices=[m.name for m in METRICS],
                        help="the metric the verdict ranks points by (default out_tok_s)")
    parser.add_argument("--repeat-key", action="append", metavar="KEY",
                        help=f"override that only repeats a point (default: {', '.join(DEFAULT_REPEAT_KEYS)}); "
                        "give it several times for several keys")
    parser.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    parser.add_argument("--no-plot", action="store_true", help=f"skip writing {PLOT_NAME}")
    args = parser.parse_args(argv)
    if not args.multirun_dir.is_dir():
        print(f"error: multirun_dir {args.multirun_dir} is not a directory", file=sys.stderr)
        return 2
    jobs = load_sweep(args.multirun_dir)
    if not jobs:
        print(f"error: no job directories (metrics.json or .hydra/) under {args.multirun_dir}", file=sys.stderr)
        return 2
    repeat_keys = tuple(args.repeat_key) if args.repeat_key else DEFAULT_REPEAT_KEYS
    try:
        text, points, _ = report(jobs, repeat_keys, args.sort, args.best_by, args.markdown)
    except SortError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text)
    if not args.no_plot:
        png = args.multirun_dir / PLOT_NAME
        if plot_sweep(points, png):
            print(f"plot: {png}")
        else:
            print("note: matplotlib is not installed (pip install matplotlib); skipped the plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
