"""Shared pieces of the launch tests: run.py's arguments, a clean environment, bounded subprocesses.

Every end-to-end launch test compares greedy tokens against one single-rank reference, so the
arguments and the way results are read live here once.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import time
from types import ModuleType
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_PY = REPO / "run.py"
PROMPTS = '["hello there","why is the sky blue"]'
# torchrun/slurm variables that would make a child process believe it is part of another launch
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
               "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def engine_args(ckpt: Path, max_tokens: int = 4) -> list[str]:
    """Hydra overrides for a tiny, greedy, CPU, float32 run (identical on every launch path)."""
    return [
        "model=qwen3", f"model.path={ckpt}", f"prompts={PROMPTS}", "device=cpu", "dtype=float32",
        "sampling.temperature=0", f"sampling.max_tokens={max_tokens}", "sampling.ignore_eos=true",
        "num_kv_blocks=64", "dist_timeout_s=60", "log_level=WARNING",
    ]


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without torchrun/slurm launch variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"})
    env.update(extra)
    return env


def run_checked(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None,
                cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run `cmd` to completion within `timeout_s` (killed after) and fail with its output if rc != 0."""
    proc = subprocess.run(cmd, cwd=cwd, env=env if env is not None else clean_env(), capture_output=True,
                          text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{cmd[:4]}... exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def run_together(launches: list[tuple[list[str], dict[str, str]]], log_dir: Path, timeout_s: float) -> None:
    """Start every (cmd, env) at once, as the processes of one launch; all must exit 0 within `timeout_s`."""
    procs = []
    try:
        for i, (cmd, env) in enumerate(launches):
            log = open(Path(log_dir) / f"proc{i}.log", "w")
            procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + timeout_s
        codes = []
        for p, _ in procs:
            try:
                codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(f"timeout after {timeout_s} s")
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    logs = "\n".join(f"--- proc{i}\n" + (Path(log_dir) / f"proc{i}.log").read_text()[-3000:] for i in range(len(procs)))
    assert codes == [0] * len(launches), f"exit codes {codes}\n{logs}"


def token_ids(job_dir: Path) -> list[list[int]]:
    """token_ids of outputs.jsonl in request order; asserts that no request failed."""
    rows = [json.loads(line) for line in (Path(job_dir) / "outputs.jsonl").read_text().splitlines() if line]
    assert [r["index"] for r in rows] == list(range(len(rows)))
    assert all(r["error"] is None for r in rows), rows
    return [r["token_ids"] for r in rows]


def read_metrics(job_dir: Path) -> dict:
    return json.loads((Path(job_dir) / "metrics.json").read_text())


def free_slurm_job_id() -> int:
    """A SLURM_JOB_ID whose derived rendezvous port (20000 + id % 20000) is free right now."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(20000, 40000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return 1_000_000 + port - 20000  # 1_000_000 % 20000 == 0
    raise RuntimeError("no free port in 20000-39999 for the slurm rendezvous")


def load_launch_script(name: str) -> ModuleType:
    """Import launch/<name>.py (launch/ is scripts, not a package) as module `name`."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here while the class is built
    spec.loader.exec_module(module)
    return module
