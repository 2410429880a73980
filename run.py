#!/usr/bin/env python3
"""spmd-engine entry point: every rank runs this same program (python, torchrun or srun).

Thin on purpose: rank discovery happens before Hydra so that only rank 0 gets an output
directory; everything else lives in spmd_engine.job.hydra_job. Ranks are discovered again, and the
process's Supervisor (signals, step watchdog, fault reports) is made, inside `main`: a Hydra
launcher may pickle `main` and run it in other processes (submitit runs it in slurm tasks).
"""
from __future__ import annotations

import shutil
import sys
import tempfile
import threading
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from spmd_engine.config import plus_unknown_overrides, store_config_defaults
from spmd_engine.distributed import RankInfo, destroy_process_group, discover_ranks
from spmd_engine.job.hydra_job import run_job
from spmd_engine.faults.supervisor import Supervisor

RANKS = discover_ranks()
store_config_defaults()  # conf/config.yaml extends the defaults the dataclasses define
SUPERVISORS: list[Supervisor] = []  # this process's one Supervisor, made by the first job it runs


def process_supervisor(ranks: RankInfo) -> Supervisor:
    if not SUPERVISORS:
        SUPERVISORS.append(Supervisor(ranks))
        if threading.current_thread() is threading.main_thread():
            SUPERVISORS[0].install_signal_handlers()  # SIGINT/SIGTERM: every rank out within seconds
    return SUPERVISORS[0]


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    ranks = discover_ranks()  # here too: a launcher may run this function in another process
    hc = HydraConfig.get()
    multirun = hc.mode.name == "MULTIRUN"
    output_dir = Path(hc.runtime.output_dir) if ranks.is_first else None
    raw = OmegaConf.to_container(cfg, resolve=True)
    metrics = run_job(raw, list(hc.overrides.task), ranks, output_dir, multirun, process_supervisor(ranks))
    return None if metrics is None else metrics.get("output_tokens_per_s")


if __name__ == "__main__":
    sys.argv[1:] = plus_unknown_overrides(sys.argv[1:])  # `max_tokens=16`: our one line, not Hydra's "not in struct"
    scratch = None
    if not RANKS.is_first:  # other ranks: no output dir, no .hydra/, no log file of their own
        scratch = tempfile.mkdtemp(prefix=f"spmd-engine-rank{RANKS.rank}-")
        sys.argv += [f"hydra.run.dir={scratch}", f"hydra.sweep.dir={scratch}", "hydra.output_subdir=null",
                     "hydra/job_logging=stdout", "hydra/hydra_logging=none"]
    try:
        main()
    finally:
        destroy_process_group()
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
