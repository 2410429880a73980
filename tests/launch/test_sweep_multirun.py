"""A real Hydra multirun with repeats on a tiny model, summarized by launch/sweep_report.py.

The sweep crosses num_kv_blocks (the CPU's pool-size knob: 4 blocks hold 64 tokens, less than the
workload=sweep preset's requests need at once) with gpu_memory_utilization (no effect on CPU: its
points are equal by construction) and +repeat=0,1. Preemptions and KV capacity are deterministic,
so the verdict on them is checked exactly; throughput is timing, so only its shape is checked.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.launch.engine_runs import RUN_PY, load_launch_script, read_metrics, run_checked

sweep_report = load_launch_script("sweep_report")
TIMEOUT_S = 180
# workload=sweep scaled to the tiny checkpoint (vocab 300, 64 positions): 8 requests, 16-40 tokens each
SMALL_SWEEP = ["workload=sweep", "workload.num_seqs=8", "workload.min_input_len=8", "workload.max_input_len=24",
               "workload.min_output_len=8", "workload.max_output_len=16", "workload.token_id_max=299"]


@pytest.fixture(scope="module")
def sweep_dir(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sweep") / "multirun"
    run_checked([sys.executable, str(RUN_PY), "-m", "model=qwen3", f"model.path={tiny_ckpt}", "device=cpu",
                 "dtype=float32", "log_level=WARNING", *SMALL_SWEEP, "+repeat=0,1", "num_kv_blocks=4,64",
                 "gpu_memory_utilization=0.5,0.9", f"hydra.sweep.dir={out}"], TIMEOUT_S)
    return out


def test_every_job_ran_and_records_its_kv_demand(sweep_dir: Path) -> None:
    jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    assert len(jobs) == 8
    for job in jobs:
        metrics = read_metrics(job)
        assert metrics["status"] == "ok", metrics.get("error")
        rows = [json.loads(line) for line in (job / "outputs.jsonl").read_text().splitlines()]
        assert metrics["kv_demand_tokens"] == sum(len(r["prompt_token_ids"]) + len(r["token_ids"]) for r in rows)


def test_table_groups_repeats_and_shows_what_the_pool_changes(sweep_dir: Path) -> None:
    jobs = sweep_report.load_sweep(sweep_dir)
    assert len(jobs) == 8 and all(j.ok for j in jobs)
    keys = sweep_report.swept_keys(jobs)
    assert keys == ["num_kv_blocks", "gpu_memory_utilization"]
    points = sweep_report.group_points(jobs, keys)
    assert [(p.value("num_kv_blocks"), p.value("gpu_memory_utilization")) for p in points] == [
        ("4", "0.5"), ("4", "0.9"), ("64", "0.5"), ("64", "0.9")]
    assert all(sorted(j.params["repeat"] for j in p.jobs) == ["0", "1"] for p in points)

    header = sweep_report.point_columns(keys)
    rows = [dict(zip(header, row)) for row in sweep_report.point_rows(points)]
    assert [r["runs"] for r in rows] == ["2/2 ok"] * 4
    assert [r["kv_tokens"] for r in rows] == ["64 ±0", "64 ±0", "1,024 ±0", "1,024 ±0"]
    small, large = points[0].stat("preempt"), points[2].stat("preempt")
    assert small.median > 0 and small.spread == 0  # the small pool preempts, the same way every repeat
    assert large.median == 0 and large.spread == 0
    assert points[0].stat("demand_x").median > 1 > points[2].stat("demand_x").median
    for p in points:
        for name in ("out_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
            stat = p.stat(name)
            assert stat is not None and stat.n == 2 and stat.median > 0, (p.label, name)


def test_equal_points_are_indistinguishable(sweep_dir: Path) -> None:
    jobs = sweep_report.load_sweep(sweep_dir)
    points = sweep_report.group_points(jobs, sweep_report.swept_keys(jobs))
    verdict = sweep_report.judge(points, "preempt")
    # the two 64-block points differ only by gpu_memory_utilization, which does nothing on CPU
    assert verdict.kind == "indistinguishable"
    assert sorted(p.label for p in verdict.tied) == ["num_kv_blocks=64 gpu_memory_utilization=0.5",
                                                    "num_kv_blocks=64 gpu_memory_utilization=0.9"]
    assert "the other 2 point(s) are worse" in verdict.text
    for name in ("preempt", "kv_tokens"):
        assert sweep_report.judge(points[:2], name).kind == "indistinguishable"  # 4 blocks at 0.5 vs 0.9
    assert sweep_report.judge([points[0], points[2]], "preempt").kind == "best"  # 64 vs 4 blocks


def test_report_command_on_the_sweep(sweep_dir: Path, capsys) -> None:
    assert sweep_report.main([str(sweep_dir), "--sort=-preempt", "--best-by", "preempt"]) == 0
    out = capsys.readouterr().out
    assert "swept: num_kv_blocks, gpu_memory_utilization; repeats: repeat" in out
    job_lines = out.split("jobs (")[1].split("points (")[0].strip().splitlines()[3:]
    assert len(job_lines) == 8 and all(line.split()[1] == "4" for line in job_lines[:4])  # most preemptions first
    assert "indistinguishable (preempt)" in out
    image = pytest.importorskip("matplotlib.image")
    assert image.imread(sweep_dir / "sweep.png").ndim == 3


def test_the_preset_oversubscribes_a_small_qwen3_pool() -> None:
    """The numbers conf/workload/sweep.yaml quotes: 244,078 KV tokens resident at
    once, 26 GiB of Qwen3-0.6B KV: 4x a gpu_memory_utilization=0.08 pool, a fifth of a 0.9 one."""
    import yaml

    from spmd_engine.job.workloads import bench_requests
    repo = RUN_PY.parent
    params = yaml.safe_load((repo / "conf" / "workload" / "sweep.yaml").read_text())
    assert params["name"] == "bench"  # the bench generator and warm-up, other numbers
    requests = bench_requests(params)
    assert len(requests) == 256
    demand = sum(len(r.prompt_token_ids) + r.overrides["max_tokens"] for r in requests)
    assert demand == 244_078
    hf = yaml.safe_load((repo / "conf" / "model" / "qwen3.yaml").read_text())["hf_config"]
    per_token = hf["num_hidden_layers"] * hf["num_key_value_heads"] * hf["head_dim"] * 2 * 2  # K and V, bf16
    assert per_token == 114_688
    gib = 1 << 30
    pool_tokens = lambda util: (139.8 * util - 4.6) * gib / per_token  # noqa: E731 (H200, enforce_eager)
    assert demand > 3.5 * pool_tokens(0.08) and demand < 0.25 * pool_tokens(0.9)


def _replay_scheduler(requests: list, pool_tokens: int, block_size: int) -> tuple[int, int, int]:
    """The engine's Scheduler alone over `requests` (no model; one step in flight, as with async
    scheduling): (preemptions, steps, step of the p99 first token). Device-independent."""
    from spmd_engine.core.scheduler import Scheduler, SchedulerConfig
    from spmd_engine.core.sequence import SamplingParams, Sequence

    sched = Scheduler(SchedulerConfig(256, 8192, 4096, block_size, pool_tokens // block_size, True), {151645})
    for i, r in enumerate(requests):
        sched.add(Sequence(i, r.prompt_token_ids, SamplingParams.from_dict(r.overrides, SamplingParams())))
    steps, first_token, in_flight = 0, {}, None
    while sched.has_unfinished() or in_flight is not None:
        out = sched.schedule() if sched.has_unfinished() else None
        if in_flight is not None:
            sampled = [s for s, flag in zip(in_flight.seqs, in_flight.sample) if flag]
            sched.postprocess(in_flight, {s.seq_id: 7 for s in sampled})
            for s in sampled:
                first_token.setdefault(s.seq_id, steps)
        in_flight = out if out is not None and not out.is_empty else None
        steps += out is not None
        assert steps < 20_000, "the scheduler made no progress"
    firsts = sorted(first_token.values())
    return sched.num_preemptions, steps, firsts[int(0.99 * len(firsts))]


def test_the_preset_preempts_at_a_small_pool_only() -> None:
    """conf/workload/sweep.yaml's replay: ~62k tokens (Qwen3-0.6B at gpu_memory_utilization 0.08, eager)
    preempts and takes ~3x the steps; ~1.1M tokens (0.9) holds every request at once."""
    import yaml

    from spmd_engine.job.workloads import bench_requests
    requests = bench_requests(yaml.safe_load((RUN_PY.parent / "conf" / "workload" / "sweep.yaml").read_text()))
    big_preempt, big_steps, big_ttft = _replay_scheduler(requests, 1_134_989, 16)
    assert big_preempt == 0
    for block_size in (16, 256):
        preempt, steps, ttft = _replay_scheduler(requests, 61_734, block_size)
        assert preempt > 0 and steps > 2.5 * big_steps and ttft > 10 * big_ttft, (block_size, preempt, steps, ttft)
