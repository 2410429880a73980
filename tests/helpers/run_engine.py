"""Run the engine as users do (`python run.py`, torchrun, or the ranks by hand), bounded in time, and
read what the job wrote; or run the same command-line arguments in-process as a cheap reference.

A hang must fail a test, never CI: every run has a timeout, and each one runs in a session of its
own so that torchrun's rank processes are killed together with it.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[2]
RUN_PY = REPO / "run.py"
# variables that would make a child believe it is a rank of some other launch
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
               "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@dataclass
class EngineRun:
    """One finished run: its exit code and output streams."""

    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return (f"{' '.join(self.cmd[:8])} ... exited {self.returncode}\n--- stdout\n{self.stdout[-4000:]}"
                f"\n--- stderr\n{self.stderr[-6000:]}")

    def check(self) -> "EngineRun":
        assert self.returncode == 0, self.describe()
        return self


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without launch variables, one thread per process (2-core CI), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def engine_command(args: list[str], nproc: int | None = None) -> list[str]:
    """`python run.py ARGS`, or torchrun with `nproc` ranks on this host."""
    if nproc is None:
        return [sys.executable, str(RUN_PY), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(RUN_PY), *args]


def run_engines(runs: list[list[str]], cwd: Path, timeout_s: float, nproc: int | None = None,
                env: dict[str, str] | None = None) -> list[EngineRun]:
    """Start every run at once (they share the machine) and wait for all of them.

    `nproc`: launch each with torchrun on that many ranks; `env`: extra environment variables.
    """
    return _run_all([(engine_command(args, nproc), engine_env(env)) for args in runs], cwd, timeout_s)


def run_engine(args: list[str], cwd: Path, timeout_s: float, nproc: int | None = None,
               env: dict[str, str] | None = None) -> EngineRun:
    return run_engines([args], cwd, timeout_s, nproc, env)[0]


def run_ranks(args: list[str], world_size: int, cwd: Path, timeout_s: float) -> list[EngineRun]:
    """The ranks of one launch started by hand (what torchrun does, without its agent), so that each
    rank's own exit code is seen: torchrun stops the other ranks as soon as one of them exits."""
    port = _free_port()
    launches = []
    for rank in range(world_size):
        env = engine_env({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        launches.append((engine_command(args), env))
    return _run_all(launches, cwd, timeout_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_all(launches: list[tuple[list[str], dict[str, str]]], cwd: Path, timeout_s: float) -> list[EngineRun]:
    """Start every (command, env) at once; whatever is still running at `timeout_s` is killed and fails."""
    deadline = time.monotonic() + timeout_s
    procs: list[tuple[subprocess.Popen, IO[str], IO[str]]] = []
    codes: list[int | None] = []
    try:
        for cmd, env in launches:  # output goes to files: a full pipe must not stall one run while we wait
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            procs.append((subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=out, stderr=err,
                                           start_new_session=True), out, err))
        for proc, _, _ in procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                _kill_session(proc)
                proc.wait()
                codes.append(None)
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                _kill_session(proc)
                proc.wait()
    results = [(EngineRun(proc.args, code, _read(out), _read(err)), code is None)
               for (proc, out, err), code in zip(procs, codes)]
    killed = [run.describe() for run, timed_out in results if timed_out]
    assert not killed, f"killed after {timeout_s} s (a hang?):\n" + "\n".join(killed)
    return [run for run, _ in results]


def _read(file: IO[str]) -> str:
    file.seek(0)
    text = file.read()
    file.close()
    return text


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the run's whole session: torchrun and every rank it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def generate_in_process(args: list[str]) -> list[list[int]]:
    """Greedy/seeded token ids of the requests `python run.py ARGS` would run, on one rank in this process.

    Composes the same Hydra config and builds the same requests as a job, without writing files;
    `hydra.*` arguments are ignored. Much cheaper than a subprocess as a single-rank reference.
    One torch thread, as engine_env gives every run: on 2 cores a second thread makes tiny ops
    (bf16 ones most) many times slower.
    """
    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from spmd_engine.config import engine_config_from_dict, store_config_defaults
    from spmd_engine.distributed import RankInfo
    from spmd_engine.engine import Engine
    from spmd_engine.tokenizer import load_tokenizer
    from spmd_engine.job.workloads import build_requests

    overrides = [a for a in args if not a.startswith("hydra.")]
    store_config_defaults()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        raw = OmegaConf.to_container(compose(config_name="config", overrides=overrides), resolve=True)
    cfg = engine_config_from_dict(raw)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = Engine(cfg, RankInfo(0, 1, 0, "127.0.0.1", 0, "single"))
        try:
            tokenizer = load_tokenizer(llm.source.tokenizer_dir) if llm.source.tokenizer_dir else None
            outputs = llm.generate(build_requests(cfg, tokenizer, llm.shape.vocab_size))
        finally:
            llm.close()
    finally:
        torch.set_num_threads(threads)
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.token_ids for o in outputs]


def read_outputs(job_dir: Path) -> list[dict]:
    """outputs.jsonl rows; they must be in submission order with one row per request index (one per
    completion, by sample_index, for a request of sampling.n > 1)."""
    rows = [json.loads(line) for line in (Path(job_dir) / "outputs.jsonl").read_text().splitlines() if line]
    keys = [(r["index"], r.get("sample_index", 0)) for r in rows]
    counts = [sum(1 for i, _ in keys if i == index) for index in range(len({i for i, _ in keys}))]
    assert keys == [(i, k) for i, count in enumerate(counts) for k in range(count)], rows
    return rows


def read_metrics(job_dir: Path) -> dict:
    return json.loads((Path(job_dir) / "metrics.json").read_text())


def token_ids(job_dir: Path) -> list[list[int]]:
    """Generated token ids per request of a run in which no request may fail."""
    rows = read_outputs(job_dir)
    assert all(r["error"] is None for r in rows), rows
    return [r["token_ids"] for r in rows]
