#!/usr/bin/env python3
"""spmd-engine entry point: every rank runs this same program (python, torchrun or srun).

Thin on purpose: rank discovery happens before Hydra so that only rank 0 gets an output
directory; everything else lives in spmd_engine.job.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from spmd_engine.distributed import destroy_process_group, discover_ranks
from spmd_engine.job import run_job

RANKS = discover_ranks()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    hc = HydraConfig.get()
    multirun = hc.mode.name == "MULTIRUN"
    output_dir = Path(hc.runtime.output_dir) if RANKS.is_first else None
    raw = OmegaConf.to_container(cfg, resolve=True)
    metrics = run_job(raw, list(hc.overrides.task), RANKS, output_dir, multirun)
    return None if metrics is None else metrics.get("output_tokens_per_s")


if __name__ == "__main__":
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
