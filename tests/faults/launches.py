"""Start engine jobs as separate processes (plain ranks or torchrun), all at once, each bounded in time.

A plain launch sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT itself, like a cluster scheduler would:
nothing but the engine can end the surviving ranks there, unlike under torchrun.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from spmd_engine.job.outputs import read_outputs
from tests.helpers.run_engine import REPO, engine_command, engine_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    """One process of a launch (a rank, or torchrun with its ranks) and, once finished, its results."""

    popen: subprocess.Popen
    out_path: Path
    err_path: Path
    returncode: int | None = None  # None: killed at the timeout
    ended: float | None = None  # time.monotonic() at exit (set by a waiter thread)

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace").replace("\r", "\n")

    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error: ")]


@dataclass
class Launch:
    name: str
    procs: list[Proc] = field(default_factory=list)

    def describe(self) -> str:
        return "\n".join(f"--- {self.name} proc {i} exited {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
                         for i, p in enumerate(self.procs))

    @property
    def returncodes(self) -> list[int | None]:
        return [p.returncode for p in self.procs]

    def error_lines(self) -> list[str]:
        return [line for p in self.procs for line in p.error_lines()]

    def all_stderr(self) -> str:
        return "".join(p.stderr for p in self.procs)


def _spawn(cmd: list[str], env: dict[str, str], logs: Path, tag: str) -> Proc:
    out, err = logs / f"{tag}.out", logs / f"{tag}.err"
    with open(out, "w") as o, open(err, "w") as e:
        popen = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=o, stderr=e, start_new_session=True)
    proc = Proc(popen, out, err)

    def note_exit() -> None:  # the exit time as it happens, not when someone polls
        popen.wait()
        proc.ended = time.monotonic()

    threading.Thread(target=note_exit, daemon=True).start()
    return proc


def start_plain(name: str, args: list[str], logs: Path, world: int = 2,
                env_by_rank: dict[int, dict[str, str]] | None = None, only: list[int] | None = None) -> Launch:
    """`world` processes of `python run.py ARGS` with the launch variables set by hand (`only`: start
    just these ranks, as if the others had died before the rendezvous)."""
    port = str(free_port())
    launch = Launch(name)
    for rank in range(world) if only is None else only:
        env = engine_env()
        env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        env.update((env_by_rank or {}).get(rank, {}))
        launch.procs.append(_spawn(engine_command(args), env, logs, f"{name}-rank{rank}"))
    return launch


def start_torchrun(name: str, args: list[str], logs: Path, nproc: int = 2) -> Launch:
    return Launch(name, [_spawn(engine_command(args, nproc), engine_env(), logs, f"{name}-torchrun")])


def finish(launches: list[Launch], timeout_s: float) -> None:
    """Wait for every process; past `timeout_s` (from now) the stragglers' sessions are killed."""
    deadline = time.monotonic() + timeout_s
    pending = [p for launch in launches for p in launch.procs]
    while pending:
        for p in list(pending):
            if p.popen.poll() is not None and p.ended is not None:
                p.returncode = p.popen.returncode
                pending.remove(p)
        if pending and time.monotonic() > deadline:
            for p in pending:
                try:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.popen.wait()
            break
        time.sleep(0.05)


def outputs_rows(job_dir: Path) -> list[dict]:
    """Complete rows of the job's outputs.jsonl, in file order (a line being written is skipped)."""
    return read_outputs(Path(job_dir) / "outputs.jsonl")


def wait_for_rows(job_dir: Path, count: int, launch: Launch, timeout_s: float) -> list[dict]:
    """Poll outputs.jsonl until it holds `count` successful rows (fails early if the launch ended)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = outputs_rows(job_dir)
        if sum(r["error"] is None for r in rows) >= count:
            return rows
        if all(p.popen.poll() is not None for p in launch.procs):
            break
        time.sleep(0.05)
    finish([launch], 0)
    raise AssertionError(f"{launch.name}: outputs.jsonl never reached {count} rows\n{launch.describe()}")
