"""torch's intra-op threads on a CPU job, chosen from the cores this process may use and the ranks that share them.

Why: torch's default is one thread per core for every rank, so N ranks on one node run N x cores
threads, and a decode step's many tiny ops then spin-wait on oversubscribed cores; one core busy with
anything else (the rank's own host loop, the tokenizer, another job) has the same effect. 2-core machine
loaded by other work, `python run.py` (SmolLM2, 4 chat prompts): ITL p50 1.33-1.78 s with 2 threads
against 0.18 s with 1 (docs/PERFORMANCE.md, "CPU: the default job"). So the auto choice shares the
cores among the node's ranks and leaves one core to the rest of the machine.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from spmd_engine.config import EngineConfig
from spmd_engine.distributed import RankInfo

log = logging.getLogger("spmd_engine")


@dataclass(frozen=True)
class ThreadChoice:
    """How many intra-op threads a rank runs (None: leave torch's own setting) and why, for the log line."""

    threads: int | None
    reason: str


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity: a cgroup or taskset limit counts, unlike os.cpu_count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform
        return os.cpu_count() or 1


def ranks_on_node(env: Mapping[str, str], world_size: int) -> int:
    """Ranks sharing this node's cores: torchrun's LOCAL_WORLD_SIZE, slurm's tasks per node, else every rank."""
    if env.get("LOCAL_WORLD_SIZE", "").isdigit():
        return int(env["LOCAL_WORLD_SIZE"])
    per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]  # "4" or "4(x2)"
    return int(per_node) if per_node.isdigit() else world_size


def auto_cpu_threads(cores: int, ranks: int) -> int:
    """cpu_threads=null: an equal share per rank on the node of the available cores but one, at least one."""
    return max(1, (cores - 1) // max(1, ranks))


def choose_cpu_threads(requested: int | None, cores: int, ranks: int, env: Mapping[str, str]) -> ThreadChoice:
    """The key wins, then an explicit OMP_NUM_THREADS (torch already follows it), then the auto share."""
    if requested is not None:
        return ThreadChoice(requested, "cpu_threads")
    if env.get("OMP_NUM_THREADS"):
        return ThreadChoice(None, f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")
    threads = auto_cpu_threads(cores, ranks)
    return ThreadChoice(threads, f"auto: {cores} cores available / {ranks} rank{'s' if ranks > 1 else ''} on this node")


def runs_on_cpu(device: str) -> bool:
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def apply_cpu_threads(cfg: EngineConfig, ranks: RankInfo, env: Mapping[str, str] | None = None) -> None:
    """Set this rank's intra-op threads before the model is built (a CPU job only), and log the choice once.

    A cpu_threads below 1 is left alone here: the config check names it before any work starts."""
    if not runs_on_cpu(cfg.device) or (cfg.cpu_threads is not None and cfg.cpu_threads < 1):
        return
    env = os.environ if env is None else env
    choice = choose_cpu_threads(cfg.cpu_threads, available_cores(), ranks_on_node(env, ranks.world_size), env)
    if choice.threads is not None:
        torch.set_num_threads(choice.threads)
    if ranks.is_first:
        log.info("CPU threads: %d per rank (%s)", torch.get_num_threads(), choice.reason)
