"""The job's run dir (Hydra's output dir, rank 0): writable, one writer at a time, no finished rows dropped.

Why: outputs.jsonl holds finished work. A rerun into the same dir used to truncate it, two jobs
writing one dir interleaved their lines and shared its .tmp, and an unwritable dir ended rank 0 in
a Hydra traceback before any collective while the other ranks waited for it. The reasons are
raised in the start-up `agreed` check, so every rank leaves with the same one line (exit 2), and a
refused job writes nothing into the dir.
"""
from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, read_write

from spmd_engine.config import ConfigError
from spmd_engine.job.outputs import read_outputs

LOCK_NAME = "outputs.jsonl.lock"


class RunDirRefused(ConfigError):
    """A user error about the run dir's contents: the job leaves it exactly as it found it."""


_REFUSED: list[str] = []  # set by RunDirCheck in this process: why Hydra's dir was not used


def refused_run_dir() -> str | None:
    """The one-line reason RunDirCheck kept Hydra out of this process's output dir, or None."""
    return _REFUSED[-1] if _REFUSED else None


class RunDirCheck(Callback):
    """Hydra callback (conf/config.yaml): a run dir that can't or must not be used becomes a user error
    of the job (one line, exit 2 on every rank) before Hydra writes anything into it.

    Hydra creates the dir, its log file and .hydra/ before calling the job. An unwritable dir failed
    there, in a traceback, before rank 0 reached the start-up collectives (the other ranks waited
    for it); a dir in use by another job, or one holding finished rows without `resume=true`, would
    get its .hydra/ config overwritten by a job that is then refused. So the dir is checked first;
    if refused, Hydra is pointed at a scratch dir (removed at exit) and the job reports the reason in
    its start-up check. The job's own checks (`claim_run_dir`) remain the authority (multirun job
    dirs, races).
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _redirect_if_refused(config, "run", check_use=True)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _redirect_if_refused(config, "sweep", check_use=False)  # job dirs are checked by each job


def _probe(directory: Path) -> None:
    """Raise OSError unless `directory` exists (or can be made) and a file can be created in it."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=directory):
        pass


def _refusal(directory: Path, key: str, resume: bool, check_use: bool) -> str | None:
    try:
        _probe(directory)
    except OSError as exc:
        return (f"{key}={str(directory)!r} is not writable ({exc.strerror or type(exc).__name__}); choose a "
                "directory this user can write (outputs.jsonl and metrics.json go there)")
    if check_use:
        try:
            lock_run_dir(directory).release()  # only a probe: the job takes the lock for its life
            check_rerun(directory, resume)
        except ConfigError as exc:
            return str(exc)
    return None


def _redirect_if_refused(config: DictConfig, kind: str, check_use: bool) -> None:
    key = f"hydra.{kind}.dir"
    try:
        directory = Path(str(OmegaConf.select(config, key)))
        resume = OmegaConf.select(config, "resume", default=False) is True
    except Exception:  # an interpolation only Hydra can resolve: leave the dir to Hydra and the job
        return
    reason = _refusal(directory, key, resume, check_use)
    if reason is None:
        return
    _REFUSED.append(reason)
    scratch = tempfile.mkdtemp(prefix="spmd-engine-refused-")
    atexit.register(shutil.rmtree, scratch, True)
    with read_write(config.hydra):
        config.hydra[kind].dir = scratch
        if kind == "sweep":  # each sweep job's config is composed again from these overrides
            config.hydra.overrides.hydra.append(f"hydra.sweep.dir={scratch}")


@dataclass
class RunDirLock:
    """An exclusive flock on the run dir's lock file, held for the job's life (the OS drops it if the
    process dies); the file is removed on release, so a finished run dir holds only its outputs."""

    path: Path
    file: IO[str]

    def release(self) -> None:
        if not self.file.closed:
            self.path.unlink(missing_ok=True)  # still locked: a newcomer now makes a new file (see lock_run_dir)
            fcntl.flock(self.file.fileno(), fcntl.LOCK_UN)
            self.file.close()


def lock_run_dir(run_dir: Path) -> RunDirLock:
    """Take the run dir's writer lock, or raise ConfigError naming the job that holds it."""
    path = Path(run_dir) / LOCK_NAME
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            file = open(path, "a+", encoding="utf-8")
        except OSError as exc:
            raise RunDirRefused(f"hydra.run.dir={str(run_dir)!r} is not writable ({exc.strerror or exc})") from None
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: another process holds it
            file.seek(0)
            holder = file.read(200).strip().splitlines()
            file.close()
            raise RunDirRefused(f"hydra.run.dir={str(run_dir)!r} is in use by another job "
                              f"({holder[0] if holder else 'unknown process'}); one job writes a run dir at a "
                              "time: wait for it to end or use another hydra.run.dir") from None
        try:
            same = os.stat(path).st_ino == os.fstat(file.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        file.close()  # its holder released and removed it between our open and flock: lock the new one
    file.seek(0)
    file.truncate()
    file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    file.flush()
    return RunDirLock(path, file)


def check_rerun(run_dir: Path, resume: bool) -> None:
    """Refuse to start over a run dir whose outputs.jsonl holds finished rows, unless resuming it."""
    outputs = Path(run_dir) / "outputs.jsonl"
    if not outputs.exists():
        return
    try:
        open(outputs, "a", encoding="utf-8").close()
    except OSError as exc:
        raise RunDirRefused(f"{str(outputs)!r} is not writable ({exc.strerror or exc})") from None
    if resume:
        return
    finished = len({row["index"] for row in read_outputs(outputs)})
    if finished:
        raise RunDirRefused(f"hydra.run.dir={str(run_dir)!r} already holds {finished} finished rows in "
                          "outputs.jsonl; pass resume=true to continue that run, or use another hydra.run.dir "
                          "(nothing was overwritten)")


def claim_run_dir(run_dir: Path, resume: bool) -> RunDirLock:
    """Rank 0's start-up check of its run dir: writable, not in use, no finished rows dropped.
    Returns the lock, to be released when the job ends."""
    reason = refused_run_dir()
    if reason is not None:
        raise RunDirRefused(reason)
    lock = lock_run_dir(run_dir)
    try:
        check_rerun(run_dir, resume)
    except BaseException:
        lock.release()
        raise
    return lock
