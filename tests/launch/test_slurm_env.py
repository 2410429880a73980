"""Two run.py processes that see only slurm's variables (as srun sets them) form one TP group."""
from __future__ import annotations

import sys
from pathlib import Path

from tests.launch.engine_runs import (RUN_PY, clean_env, engine_args, free_slurm_job_id, read_metrics, run_together,
                                      token_ids)

TIMEOUT_S = 120


def test_two_slurm_tasks_match_a_single_process(tiny_ckpt: Path, reference_tokens: list[list[int]],
                                                tmp_path: Path) -> None:
    job_id = str(free_slurm_job_id())
    out_dir = tmp_path / "run"
    cmd = [sys.executable, str(RUN_PY), *engine_args(tiny_ckpt), f"hydra.run.dir={out_dir}"]
    run_together([(cmd, clean_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                                  SLURM_NODEID="0", SLURM_STEP_NODELIST="127.0.0.1", SLURM_JOB_ID=job_id))
                  for rank in range(2)], tmp_path, TIMEOUT_S)
    assert token_ids(out_dir) == reference_tokens
    metrics = read_metrics(out_dir)
    assert metrics["status"] == "ok" and metrics["world_size"] == 2
