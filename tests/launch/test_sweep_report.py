"""launch/sweep_report.py on synthetic multirun directories (no engine needed)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.launch.engine_runs import load_launch_script

sweep_report = load_launch_script("sweep_report")


def _job(root: Path, num: int, overrides: list[str], tok_s: float | None = None, preempt: int = 0,
         kv_tokens: int = 1024, ttft_p99: float = 40.0, error: str | None = None,
         write_metrics: bool = True) -> None:
    job = root / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if not write_metrics:
        return
    metrics: dict = {"status": "ok" if error is None else "failed", "overrides": overrides}
    if error is None:
        metrics.update({"output_tokens_per_s": tok_s, "ttft": {"count": 2, "p50_ms": 12.5, "p99_ms": ttft_p99},
                        "itl": {"count": 6, "p50_ms": 3.25, "p99_ms": 9.5}, "engine": {"preemptions": preempt},
                        "kv_capacity": {"blocks": kv_tokens // 16, "tokens": kv_tokens}, "kv_demand_tokens": 2048,
                        "peak_gpu_memory_gib": 3.5})
    else:
        metrics["error"] = error
    (job / "metrics.json").write_text(json.dumps(metrics))


def _point_sweep(root: Path, results: dict[tuple[int, float], list[float]]) -> Path:
    """block_size x gpu_memory_utilization with +repeat=i; results: (bs, util) -> tok/s per repeat."""
    root.mkdir(parents=True, exist_ok=True)
    num = 0
    for (bs, util), values in results.items():
        for rep, tok_s in enumerate(values):
            _job(root, num, [f"block_size={bs}", f"gpu_memory_utilization={util}", f"+repeat={rep}", "device=cpu"],
                 tok_s)
            num += 1
    return root


@pytest.fixture
def plain_sweep(tmp_path: Path) -> Path:
    """Four points without repeats, one failed, one that died before writing metrics.json."""
    root = tmp_path / "multirun"
    root.mkdir()
    (root / "multirun.yaml").write_text("hydra: {}\n")
    _job(root, 0, ["block_size=16", "gpu_memory_utilization=0.5", "device=cpu"], 100.0, preempt=7, kv_tokens=512)
    _job(root, 1, ["block_size=16", "gpu_memory_utilization=0.9", "device=cpu"], 120.0)
    _job(root, 2, ["block_size=32", "gpu_memory_utilization=0.5", "device=cpu"], 150.0, preempt=3, kv_tokens=512)
    _job(root, 3, ["block_size=32", "gpu_memory_utilization=0.9", "device=cpu"],
         error="num_kv_blocks=1 holds 32 tokens but one request needs 40")
    _job(root, 10, ["block_size=64", "gpu_memory_utilization=0.9", "device=cpu"], write_metrics=False)
    return root


def test_load_sweep_reads_every_job_in_numeric_order(plain_sweep: Path) -> None:
    jobs = sweep_report.load_sweep(plain_sweep)
    assert [j.job for j in jobs] == ["0", "1", "2", "3", "10"]
    assert [j.params["block_size"] for j in jobs] == ["16", "16", "32", "32", "64"]
    assert [j.status for j in jobs] == ["ok", "ok", "ok", "failed", "missing"]
    first = jobs[0].values
    assert first["out_tok_s"] == 100.0 and first["preempt"] == 7 and first["kv_tokens"] == 512
    assert first["kv_blocks"] == 32 and first["demand_x"] == 4.0 and first["peak_gib"] == 3.5
    assert first["ttft_p99_ms"] == 40.0 and first["itl_p50_ms"] == 3.25 and first["itl_p99_ms"] == 9.5
    assert jobs[3].values["out_tok_s"] is None and "num_kv_blocks=1" in jobs[3].error
    assert "metrics.json" in jobs[4].error
    assert sweep_report.swept_keys(jobs) == ["block_size", "gpu_memory_utilization"]  # device is fixed


def test_any_swept_key_is_a_column(tmp_path: Path) -> None:
    for num, (seqs, blocks) in enumerate([(8, 4), (8, 64), (16, 4), (16, 64)]):
        _job(tmp_path, num, [f"workload.num_seqs={seqs}", f"num_kv_blocks={blocks}", "model=qwen3"], 10.0 + num)
    jobs = sweep_report.load_sweep(tmp_path)
    keys = sweep_report.swept_keys(jobs)
    assert keys == ["workload.num_seqs", "num_kv_blocks"]
    header = sweep_report.job_columns(keys, [])
    rows = sweep_report.job_rows(jobs, keys, [])
    assert header[:3] == ["job", "workload.num_seqs", "num_kv_blocks"]
    assert [r[1:3] for r in rows] == [("8", "4"), ("8", "64"), ("16", "4"), ("16", "64")]
    text, _, _ = sweep_report.report(jobs, ("repeat",), None, "out_tok_s")
    assert "fixed: model=qwen3" in text


def test_job_table_cells(plain_sweep: Path) -> None:
    jobs = sweep_report.load_sweep(plain_sweep)
    keys = sweep_report.swept_keys(jobs)
    header = sweep_report.job_columns(keys, [])
    rows = sweep_report.job_rows(jobs, keys, [])
    row = dict(zip(header, rows[0]))
    assert (row["block_size"], row["gpu_memory_utilization"], row["status"]) == ("16", "0.5", "ok")
    assert (row["kv_tokens"], row["kv_blocks"], row["preempt"], row["out_tok_s"]) == ("512", "32", "7", "100.0")
    assert (row["ttft_p50_ms"], row["ttft_p99_ms"], row["itl_p99_ms"], row["peak_gib"]) == (
        "12.5", "40.0", "9.50", "3.50")
    failed = dict(zip(header, rows[3]))
    assert failed["status"] == "failed" and failed["out_tok_s"] == "-"
    assert failed["error"].startswith("num_kv_blocks=1")
    lines = sweep_report.format_table(header, rows).splitlines()
    assert lines[0].split()[:3] == ["job", "block_size", "gpu_memory_utilization"]
    assert len(lines) == 2 + len(jobs)


def test_long_errors_are_cut_to_one_line(tmp_path: Path) -> None:
    _job(tmp_path, 0, ["block_size=16"], error="x" * 300 + "\nsecond line")
    row = sweep_report.job_rows(sweep_report.load_sweep(tmp_path), [], [])[0]
    assert len(row[-1]) == sweep_report.ERROR_WIDTH and row[-1].endswith("...") and "\n" not in row[-1]


def test_sort_by_any_column(plain_sweep: Path) -> None:
    jobs = sweep_report.load_sweep(plain_sweep)
    keys = sweep_report.swept_keys(jobs)
    by = lambda spec: [j.job for j in sweep_report.sort_jobs(jobs, spec, keys, [])]  # noqa: E731
    assert by("out_tok_s") == ["0", "1", "2", "3", "10"]  # failed/missing (no value) last either way
    assert by("-out_tok_s") == ["2", "1", "0", "3", "10"]
    assert by("-preempt") == ["0", "2", "1", "3", "10"]
    assert by("-block_size") == ["10", "2", "3", "0", "1"]
    assert by("-job") == ["10", "3", "2", "1", "0"]
    with pytest.raises(sweep_report.SortError, match="no column 'tok_s'"):
        by("tok_s")


def test_sort_is_numeric_not_textual(tmp_path: Path) -> None:
    for num, bs in enumerate([256, 16, 32]):
        _job(tmp_path, num, [f"block_size={bs}"], 1.0)
    jobs = sweep_report.load_sweep(tmp_path)
    assert [j.params["block_size"] for j in sweep_report.sort_jobs(jobs, "block_size", ["block_size"], [])] == [
        "16", "32", "256"]
    points = sweep_report.group_points(jobs, ["block_size"])
    assert [p.value("block_size") for p in points] == ["16", "32", "256"]


def test_repeats_group_into_points_with_median_and_spread(tmp_path: Path) -> None:
    root = _point_sweep(tmp_path, {(16, 0.5): [100.0, 110.0, 104.0], (16, 0.9): [200.0, 190.0, 196.0]})
    jobs = sweep_report.load_sweep(root)
    keys = sweep_report.swept_keys(jobs)
    assert keys == ["gpu_memory_utilization"]  # block_size is fixed, repeat is not a swept key
    points = sweep_report.group_points(jobs, keys)
    assert [p.label for p in points] == ["gpu_memory_utilization=0.5", "gpu_memory_utilization=0.9"]
    assert [[j.job for j in p.jobs] for p in points] == [["0", "1", "2"], ["3", "4", "5"]]
    stat = points[0].stat("out_tok_s")
    assert (stat.median, stat.low, stat.high, stat.n, stat.spread) == (104.0, 100.0, 110.0, 3, 10.0)
    header = sweep_report.point_columns(keys)
    row = dict(zip(header, sweep_report.point_rows(points)[0]))
    assert row["runs"] == "3/3 ok" and row["out_tok_s"] == "104.0 ±5.0" and row["preempt"] == "0 ±0"
    by_repeat, _, _ = sweep_report.report(jobs, ("repeat",), "-repeat", "out_tok_s")  # a job-table column
    assert [line.split()[0] for line in by_repeat.split("jobs (")[1].splitlines()[3:5]] == ["2", "5"]
    text, _, _ = sweep_report.report(jobs, ("repeat",), "-out_tok_s", "out_tok_s")
    assert "repeats: repeat" in text
    points_table = text.split("points (")[1]
    assert points_table.index("196.0 ±5.0") < points_table.index("104.0 ±5.0")  # sorted descending


def _verdict(tmp_path: Path, results: dict, best_by: str = "out_tok_s"):
    jobs = sweep_report.load_sweep(_point_sweep(tmp_path / "sweep", results))
    return sweep_report.judge(sweep_report.group_points(jobs, sweep_report.swept_keys(jobs)), best_by)


def test_verdict_names_the_best_only_beyond_the_spread(tmp_path: Path) -> None:
    v = _verdict(tmp_path, {(16, 0.5): [100.0, 110.0, 104.0], (16, 0.9): [150.0, 160.0, 154.0],
                            (32, 0.9): [120.0, 121.0, 119.0]})
    assert v.kind == "best" and v.leader.label == "block_size=16 gpu_memory_utilization=0.9"
    assert v.runner_up.label == "block_size=32 gpu_memory_utilization=0.9"
    assert (v.margin, v.spread) == (34.0, 10.0)
    assert v.text.startswith("best (out_tok_s): block_size=16 gpu_memory_utilization=0.9 at 154.0")


def test_verdict_indistinguishable_when_the_margin_is_within_the_spread(tmp_path: Path) -> None:
    # 0.9 leads by 4 tok/s; its repeats spread over 10: noise, not an effect. 32/0.5 is clearly worse.
    v = _verdict(tmp_path, {(16, 0.5): [100.0, 110.0, 104.0], (16, 0.9): [101.0, 111.0, 108.0],
                            (32, 0.5): [50.0, 52.0, 51.0]})
    assert v.kind == "indistinguishable"
    assert [p.label for p in v.tied] == ["block_size=16 gpu_memory_utilization=0.9",
                                         "block_size=16 gpu_memory_utilization=0.5"]
    assert "best" not in v.text and "the other 1 point(s) are worse" in v.text


def test_verdict_on_equal_points_is_indistinguishable(tmp_path: Path) -> None:
    v = _verdict(tmp_path, {(16, 0.5): [100.0, 100.0], (16, 0.9): [100.0, 100.0]})
    assert v.kind == "indistinguishable" and v.margin == 0.0 and v.spread == 0.0


def test_verdict_lower_is_better_for_latency_and_preemptions(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    root.mkdir()
    for num, (util, rep, preempt, ttft) in enumerate([(0.1, 0, 40, 900.0), (0.1, 1, 40, 950.0),
                                                      (0.9, 0, 0, 300.0), (0.9, 1, 0, 320.0)]):
        _job(root, num, [f"gpu_memory_utilization={util}", f"+repeat={rep}"], 1.0, preempt=preempt, ttft_p99=ttft)
    points = sweep_report.group_points(sweep_report.load_sweep(root), ["gpu_memory_utilization"])
    for metric in ("preempt", "ttft_p99_ms"):
        v = sweep_report.judge(points, metric)
        assert v.kind == "best" and v.leader.label == "gpu_memory_utilization=0.9", metric


def test_verdict_without_repeats_cannot_tell(plain_sweep: Path) -> None:
    jobs = sweep_report.load_sweep(plain_sweep)
    points = sweep_report.group_points(jobs, sweep_report.swept_keys(jobs))
    v = sweep_report.judge(points, "out_tok_s")
    assert v.kind == "no_repeats" and "+repeat=0,1,2" in v.text and "best" not in v.text


def test_main_prints_tables_verdict_and_writes_a_decodable_png(tmp_path: Path, capsys) -> None:
    image = pytest.importorskip("matplotlib.image")
    root = _point_sweep(tmp_path / "sweep", {(16, 0.5): [100.0, 110.0], (16, 0.9): [150.0, 160.0],
                                             (256, 0.5): [90.0, 95.0], (256, 0.9): [149.0, 152.0]})
    _job(root, 99, ["block_size=256", "gpu_memory_utilization=0.9", "+repeat=2", "device=cpu"], error="boom")
    assert sweep_report.main([str(root), "--sort=-out_tok_s"]) == 0
    out = capsys.readouterr().out
    assert "points (median" in out and "2/3 ok (1 not)" in out
    assert "indistinguishable (out_tok_s): block_size=16 gpu_memory_utilization=0.9, block_size=256" in out
    pixels = image.imread(root / "sweep.png")
    assert pixels.ndim == 3 and pixels.shape[0] > 400 and pixels.shape[1] > 400  # 4 rows x 2 columns of panels
    assert pixels.std() > 0  # not a blank canvas


def test_main_markdown_and_bad_sort(plain_sweep: Path, capsys) -> None:
    assert sweep_report.main([str(plain_sweep), "--markdown", "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "| job | block_size | gpu_memory_utilization | status |" in out
    assert sweep_report.main([str(plain_sweep), "--sort", "nope", "--no-plot"]) == 2
    assert "no column 'nope'" in capsys.readouterr().err


def test_main_without_matplotlib_skips_the_plot(plain_sweep: Path, capsys, monkeypatch) -> None:
    import builtins
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert sweep_report.main([str(plain_sweep)]) == 0
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (plain_sweep / "sweep.png").exists()


def test_main_rejects_an_empty_directory(tmp_path: Path, capsys) -> None:
    assert sweep_report.main([str(tmp_path)]) == 2
    assert "no job directories" in capsys.readouterr().err
