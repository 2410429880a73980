"""A stopped job leaves its run dir ready for the resume: no lock file, a metrics.json that says it was
stopped and what had finished; a finished job says where its outputs went; a resumed job's metrics.json
keeps the earlier runs' figures."""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from tests.faults.launches import finish, start_plain, wait_for_rows
from tests.faults.test_stop_signals import GOOD, HANG_STEP, job_args, prompt_lines


def test_a_stopped_job_writes_its_metrics_and_drops_its_lock(fault_ckpt: Path, tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(prompt_lines()) + "\n")
    job_dir = tmp_path / "job"
    hang = ["+fault.rank=0", f"+fault.step={HANG_STEP}", "+fault.kind=hang"]
    job = start_plain("stopped", job_args(fault_ckpt, prompts, job_dir, *hang), tmp_path, world=1)
    wait_for_rows(job_dir, 3, job, timeout_s=120)
    time.sleep(0.5)
    job.procs[0].popen.send_signal(signal.SIGTERM)
    finish([job], timeout_s=30)
    assert job.returncodes == [128 + signal.SIGTERM], job.describe()

    assert not (job_dir / "outputs.jsonl.lock").exists()
    metrics = json.loads((job_dir / "metrics.json").read_text())
    rows = [json.loads(line) for line in (job_dir / "outputs.jsonl").read_text().splitlines()]
    assert metrics["status"] == "stopped" and "stopped before the end" in metrics["error"], metrics
    assert metrics["rows_written"] == len(rows) and metrics["num_requests"] == len(rows) >= 3, metrics
    assert metrics["output_tokens"] == 2 * sum(r["error"] is None for r in rows), metrics
    assert "outputs: " not in job.procs[0].stdout  # only a job that ran to its end says where its outputs are

    resume = start_plain("resumed", job_args(fault_ckpt, prompts, job_dir, "resume=true"), tmp_path, world=1)
    finish([resume], timeout_s=120)
    assert resume.returncodes == [0], resume.describe()
    last = resume.procs[0].stdout.strip().splitlines()[-1]
    assert last == f"outputs: {job_dir / 'outputs.jsonl'} (metrics: {job_dir / 'metrics.json'})", last
    assert len((job_dir / "outputs.jsonl").read_text().splitlines()) == len(prompt_lines()) > len(GOOD)

    # the resumed run's metrics.json keeps the stopped run's figures beside its own, and the job's totals
    resumed = json.loads((job_dir / "metrics.json").read_text())
    assert resumed["status"] == "ok" and resumed["resumed"] is True, resumed
    assert [run["status"] for run in resumed["previous_runs"]] == ["stopped"]
    assert resumed["previous_runs"][0]["num_requests"] == metrics["num_requests"]
    assert resumed["num_requests"] == len(prompt_lines()) - metrics["num_requests"]  # this run's part
    assert resumed["job_totals"]["num_requests"] == len(prompt_lines()) and resumed["job_totals"]["runs"] == 2
    assert resumed["job_totals"]["output_tokens"] == 2 * len(GOOD)

    # resuming the finished job runs nothing and loses nothing
    again = start_plain("again", job_args(fault_ckpt, prompts, job_dir, "resume=true"), tmp_path, world=1)
    finish([again], timeout_s=120)
    assert again.returncodes == [0], again.describe()
    final = json.loads((job_dir / "metrics.json").read_text())
    assert final["num_requests"] == 0 and final["resumed"] is True, final
    assert [run["status"] for run in final["previous_runs"]] == ["stopped", "ok"]
    assert final["previous_runs"][1]["num_requests"] == resumed["num_requests"]
    assert final["job_totals"]["num_requests"] == len(prompt_lines()) and final["job_totals"]["runs"] == 3
