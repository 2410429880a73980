"""Hydra multirun under torchrun at 2 ranks: one job dir per point, failed points don't stop the sweep."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.launch.engine_runs import RUN_PY, engine_args, load_launch_script, read_metrics, run_checked, token_ids

TIMEOUT_S = 180


sweep_report = load_launch_script("sweep_report")


def _torchrun_sweep(ckpt: Path, sweep_dir: Path, *sweep: str, drop: str | None = None) -> None:
    args = [a for a in engine_args(ckpt) if drop is None or not a.startswith(f"{drop}=")]
    run_checked([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 str(RUN_PY), "-m", *args, *sweep, f"hydra.sweep.dir={sweep_dir}"], TIMEOUT_S)


def test_block_size_by_utilization_sweep_at_two_ranks(tiny_ckpt: Path, reference_tokens: list[list[int]],
                                                     tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    _torchrun_sweep(tiny_ckpt, sweep_dir, "block_size=16,32", "gpu_memory_utilization=0.5,0.9")
    job_dirs = sorted((p for p in sweep_dir.iterdir() if p.is_dir()), key=lambda p: int(p.name))
    assert [p.name for p in job_dirs] == ["0", "1", "2", "3"]
    for job in job_dirs:
        metrics = read_metrics(job)
        assert metrics["status"] == "ok", metrics.get("error")
        assert metrics["world_size"] == 2
        assert token_ids(job) == reference_tokens  # the KV block size must not change greedy tokens

    jobs = sweep_report.load_sweep(sweep_dir)  # one row per job: rank 0's metrics.json
    assert [(j.params["block_size"], j.params["gpu_memory_utilization"], j.status) for j in jobs] == [
        ("16", "0.5", "ok"), ("16", "0.9", "ok"), ("32", "0.5", "ok"), ("32", "0.9", "ok")]
    assert all(j.values["out_tok_s"] > 0 and j.values["kv_blocks"] == 64 and j.values["preempt"] == 0
               for j in jobs)
    assert [j.values["kv_tokens"] for j in jobs] == [1024, 1024, 2048, 2048]
    assert sweep_report.main([str(sweep_dir)]) == 0
    image = pytest.importorskip("matplotlib.image")
    assert image.imread(sweep_dir / "sweep.png").ndim == 3


def test_a_failing_point_is_reported_and_the_sweep_goes_on(tiny_ckpt: Path, reference_tokens: list[list[int]],
                                                           tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    # one 16-token block cannot hold one max_model_len (64) sequence: a config error for that point only
    _torchrun_sweep(tiny_ckpt, sweep_dir, "num_kv_blocks=1,64", drop="num_kv_blocks")
    failed, ok = read_metrics(sweep_dir / "0"), read_metrics(sweep_dir / "1")
    assert failed["status"] == "failed" and "KV pool" in failed["error"]
    assert not (sweep_dir / "0" / "outputs.jsonl").exists() or token_ids(sweep_dir / "0") == []
    assert ok["status"] == "ok"
    assert token_ids(sweep_dir / "1") == reference_tokens
    assert [j.status for j in sweep_report.load_sweep(sweep_dir)] == ["failed", "ok"]
