"""srun and sbatch on a real slurm (launch/local_slurm.sh up in CI) reproduce single-process tokens."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.launch.engine_runs import REPO, clean_env, engine_args, read_metrics, token_ids

LOCAL_SLURM_CONF = Path("/tmp/spmd-slurm/slurm.conf")  # where launch/local_slurm.sh writes it
TIMEOUT_S = 120
pytestmark = pytest.mark.slurm


def _slurm_ready(conf: Path) -> str | None:
    """None when srun/sbatch can run here, else why not."""
    if not conf.is_file():
        return f"no slurm config at {conf} (run: sudo bash launch/local_slurm.sh up)"
    for tool in ("srun", "sbatch", "sinfo", "scancel"):
        if shutil.which(tool) is None:
            return f"{tool} not on PATH"
    try:
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], env={**os.environ, "SLURM_CONF": str(conf)},
                                capture_output=True, text=True, timeout=15).stdout.split()
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 15 s"
    if not any(s.rstrip("*~#").startswith(("idle", "mix", "alloc")) for s in states):
        return f"no usable slurm node (sinfo states: {states or 'none'})"
    return None


SLURM_CONF = Path(os.environ.get("SLURM_CONF", LOCAL_SLURM_CONF))
_why_not = _slurm_ready(SLURM_CONF)
if _why_not:
    pytestmark = [pytest.mark.slurm, pytest.mark.skip(reason=f"slurm unavailable: {_why_not}")]


def _slurm_run(cmd: list[str], job_name: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run a slurm client command bounded in time; on timeout cancel the job so nothing lingers."""
    env = clean_env(SLURM_CONF=str(SLURM_CONF), PYTHON=sys.executable)
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--name", job_name], env=env, timeout=15)
        pytest.fail(f"{cmd[0]} did not finish in {TIMEOUT_S} s (job {job_name} cancelled)")
    logs = "\n".join(p.read_text()[-4000:] for p in tmp_path.glob("slurm-*.out"))
    assert proc.returncode == 0, (f"{cmd[0]} exited {proc.returncode}\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-4000:]}\n{logs}")
    return proc


def test_srun_two_tasks_match_a_single_process(tiny_ckpt: Path, reference_tokens: list[list[int]],
                                               tmp_path: Path) -> None:
    name = f"spmd-test-{uuid.uuid4().hex[:8]}"
    out_dir = tmp_path / "run"
    _slurm_run(["srun", "-N1", "-n2", "--cpus-per-task=1", "--time=3", f"--job-name={name}",
                "--kill-on-bad-exit=1", sys.executable, "run.py", *engine_args(tiny_ckpt),
                f"hydra.run.dir={out_dir}"], name, tmp_path)
    assert token_ids(out_dir) == reference_tokens
    assert read_metrics(out_dir)["world_size"] == 2


def _wait_for_job(job_id: str, env: dict[str, str], timeout_s: float) -> dict[str, str]:
    """Poll `scontrol show job` (sbatch --wait backs off to ~30 s sleeps) until the job ends."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True,
                             timeout=15).stdout
        fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
        if fields.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return fields
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], env=env, timeout=15)
    pytest.fail(f"slurm job {job_id} did not end in {timeout_s} s (cancelled)")


def test_sbatch_script_matches_a_single_process(tiny_ckpt: Path, reference_tokens: list[list[int]],
                                                tmp_path: Path) -> None:
    name = f"spmd-test-{uuid.uuid4().hex[:8]}"
    out_dir = tmp_path / "run"
    # the script asks for 8 tasks and 8 GPUs per node; a 2-CPU test node overrides both
    proc = _slurm_run(["sbatch", "--parsable", f"--job-name={name}", "--ntasks-per-node=2", "--gpus-per-node=0",
                       "--cpus-per-task=1", "--time=3", f"--output={tmp_path}/slurm-%j.out",
                       "launch/slurm.sbatch", *engine_args(tiny_ckpt), f"hydra.run.dir={out_dir}"], name, tmp_path)
    job_id = proc.stdout.strip().split(";")[0]
    job = _wait_for_job(job_id, clean_env(SLURM_CONF=str(SLURM_CONF)), TIMEOUT_S)
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert "2 tasks" in log
    assert token_ids(out_dir) == reference_tokens
    assert read_metrics(out_dir)["world_size"] == 2


def test_submitit_launcher_runs_each_point_as_one_two_task_job(tiny_ckpt: Path, reference_tokens: list[list[int]],
                                                                tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the `slurm` extra is not installed")
    name = f"spmd-test-{uuid.uuid4().hex[:8]}"
    sweep_dir = tmp_path / "sweep"
    _slurm_run([sys.executable, "run.py", "-m", "hydra/launcher=spmd_slurm", "hydra.launcher.tasks_per_node=2",
                "hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=3",
                f"hydra.launcher.name={name}", *engine_args(tiny_ckpt), "block_size=16,32",
                f"hydra.sweep.dir={sweep_dir}"], name, tmp_path)
    for job in ("0", "1"):
        metrics = read_metrics(sweep_dir / job)
        assert metrics["status"] == "ok" and metrics["world_size"] == 2, metrics
        assert token_ids(sweep_dir / job) == reference_tokens
