"""launch/sweep_report.py on fake multirun directories (no engine needed)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.launch.engine_runs import load_launch_script

sweep_report = load_launch_script("sweep_report")


def _job(root: Path, num: int, block_size: int, util: float, tok_s: float | None, error: str | None = None,
         write_metrics: bool = True) -> None:
    job = root / str(num)
    (job / ".hydra").mkdir(parents=True)
    overrides = [f"block_size={block_size}", f"gpu_memory_utilization={util}", "device=cpu"]
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if not write_metrics:
        return
    metrics = {"status": "ok" if error is None else "failed", "overrides": overrides,
               "config": {"block_size": block_size, "gpu_memory_utilization": util}}
    if error is None:
        metrics.update({"output_tokens_per_s": tok_s, "ttft": {"count": 2, "p50_ms": 12.5},
                        "itl": {"count": 6, "p50_ms": 3.25}, "kv_capacity": {"blocks": 64, "tokens": 64 * block_size}})
    else:
        metrics["error"] = error
    (job / "metrics.json").write_text(json.dumps(metrics))


@pytest.fixture
def sweep_dir(tmp_path: Path) -> Path:
    root = tmp_path / "multirun"
    (root).mkdir()
    (root / "multirun.yaml").write_text("hydra: {}\n")
    _job(root, 0, 16, 0.5, 100.0)
    _job(root, 1, 16, 0.9, 120.0)
    _job(root, 2, 32, 0.5, 150.0)
    _job(root, 3, 32, 0.9, None, error="num_kv_blocks=1 holds 32 tokens but one request needs 40")
    _job(root, 10, 64, 0.9, None, write_metrics=False)  # died before writing metrics.json
    return root


def test_load_sweep_reads_every_job_in_numeric_order(sweep_dir: Path) -> None:
    points = sweep_report.load_sweep(sweep_dir)
    assert [p.job for p in points] == ["0", "1", "2", "3", "10"]
    assert [p.block_size for p in points] == [16, 16, 32, 32, 64]
    assert [p.gpu_memory_utilization for p in points] == [0.5, 0.9, 0.5, 0.9, 0.9]
    assert [p.status for p in points] == ["ok", "ok", "ok", "failed", "missing"]
    assert points[2].output_tokens_per_s == 150.0 and points[2].kv_blocks == 64
    assert points[0].ttft_p50_ms == 12.5 and points[0].itl_p50_ms == 3.25
    assert points[3].output_tokens_per_s is None and "num_kv_blocks=1" in points[3].error
    assert "metrics.json" in points[4].error


def test_table_rows_and_text(sweep_dir: Path) -> None:
    points = sweep_report.load_sweep(sweep_dir)
    rows = sweep_report.table_rows(points)
    assert rows[0] == ("0", "16", "0.50", "ok", "100.0", "12.5", "3.25", "64", "-")
    assert rows[3][:4] == ("3", "32", "0.90", "failed") and rows[3][4] == "-"
    assert rows[3][-1].startswith("num_kv_blocks=1")
    text = sweep_report.format_table(points)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["job", "block_size", "gpu_mem_util"]
    assert len(lines) == 2 + len(points)


def test_long_errors_are_cut_to_one_line(tmp_path: Path) -> None:
    _job(tmp_path, 0, 16, 0.9, None, error="x" * 300 + "\nsecond line")
    row = sweep_report.table_rows(sweep_report.load_sweep(tmp_path))[0]
    assert len(row[-1]) == sweep_report.ERROR_WIDTH and row[-1].endswith("...") and "\n" not in row[-1]


def test_main_prints_table_and_writes_a_decodable_png(sweep_dir: Path, capsys) -> None:
    image = pytest.importorskip("matplotlib.image")
    assert sweep_report.main([str(sweep_dir)]) == 0
    out = capsys.readouterr().out
    assert "best: job 2 (block_size=32" in out
    pixels = image.imread(sweep_dir / "sweep.png")
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.std() > 0  # not a blank canvas


def test_main_without_matplotlib_skips_the_plot(sweep_dir: Path, capsys, monkeypatch) -> None:
    import builtins
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert sweep_report.main([str(sweep_dir)]) == 0
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (sweep_dir / "sweep.png").exists()


def test_main_rejects_an_empty_directory(tmp_path: Path, capsys) -> None:
    assert sweep_report.main([str(tmp_path)]) == 2
    assert "no job directories" in capsys.readouterr().err
