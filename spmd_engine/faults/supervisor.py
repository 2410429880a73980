"""Supervisor: stops every rank of a failing job within seconds and has one rank say why, once.

Why: in an SPMD job one rank's fault leaves the others blocked in collectives (a dead peer) or
waiting for a plan that never comes. Whatever stops a rank first (its own exception, a failed
collective, a signal, its watchdog, another rank's post) ends up in `_stop`: post a one-line
account on the FaultBoard, let one rank (0, or a survivor if 0 is gone) print the summary, exit
the process with os._exit (threads blocked in C calls can't hold it up).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager

from spmd_engine.distributed import RankInfo, RendezvousUnreachable
from spmd_engine.faults.error_line import report_error as _report_error
from spmd_engine.faults.fault_board import ERROR, LOST, PEER, SIGNAL, TIMEOUT, FaultBoard, FaultEntry
from spmd_engine.faults.fault_summary import summarize_faults
from spmd_engine.faults.progress import IDLE, Phase, StepProgress
from spmd_engine.faults.signals import SignalThread, install_signal_thread
from spmd_engine.faults.start_gate import StartGate
from spmd_engine.faults.stack_location import Location, exception_location, thread_location
from spmd_engine.faults.watchdog import Watchdog, WatchdogCallbacks

EXIT_FAULT = 1
GRACE_S = 3.0  # how long a rank waits for the others' posts / for the report before exiting
POLL_S = 0.05


def report_error(message: str) -> None:
    _report_error(message, fresh_line=True)


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _describe(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return _one_line(f"{type(exc).__name__}: {first}" if first else type(exc).__name__)


class Supervisor:
    """One per process (run.py makes it); `progress` goes to the engine, `fail` gets any exception."""

    def __init__(self, ranks: RankInfo, grace_s: float = GRACE_S,
                 exit_fn: Callable[[int], None] = os._exit) -> None:
        self.ranks = ranks
        self.grace_s = grace_s
        self.progress = StepProgress()
        self.board: FaultBoard | None = None
        self.watchdog: Watchdog | None = None
        self.signals: SignalThread | None = None
        self._exit = exit_fn
        self._leaving_code: int | None = None  # set once every rank agreed to exit with this code
        self._lock = threading.Lock()
        self._stopping = False
        self._exit_hooks: list[Callable[[], None]] = []
        self.jobs = 0  # jobs attached so far (a multirun runs several in one process)
        self._main = threading.main_thread()

    # --- setup --------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        if self.signals is None:
            self.signals = install_signal_thread(self.on_signal)

    def attach(self, timeout_s: float) -> None:
        """Each job, once the process group exists: watch steps with `timeout_s`; join the fault board."""
        self.progress.timeout_s = timeout_s
        self.jobs += 1
        if self.watchdog is not None or self.ranks.world_size == 1:
            return  # one process has no peer to wait for: a long step is only a long step
        if self.ranks.world_size > 1 and self.board is None:
            self.board = FaultBoard.connect(self.ranks.master_addr, self.ranks.master_port, self.ranks.world_size,
                                            max(10.0, self.grace_s), str(self.ranks.restart_count))
        callbacks = WatchdogCallbacks(self.on_timeout, self.on_peer_post, self.on_board_lost, self.on_peer_silent)
        self.watchdog = Watchdog(self.progress, self.board, callbacks, rank=self.ranks.rank).start()

    def start_gate(self) -> StartGate | None:
        """This job's gate between rank 0's request reading and the first plan (None: one process)."""
        if self.board is None:
            return None
        return StartGate(self.board.store, f"spmd_engine/gate/{self.ranks.restart_count}/{self.jobs}")

    def detach(self) -> None:
        """Stop watching (the job's work is done, or every rank agreed to stop): peers may exit now."""
        self.progress.idle()
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    @contextmanager
    def before_exit(self, hook: Callable[[], None]):
        """Run `hook` (e.g. finish the outputs line being written) if the process is stopped meanwhile."""
        self._exit_hooks.append(hook)
        try:
            yield
        finally:
            self._exit_hooks.remove(hook)

    # --- triggers -----------------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """The main thread caught `exc` (distributed jobs only: this never returns)."""
        if isinstance(exc, RendezvousUnreachable):  # no store, no peers to tell: its message is the line
            with self._lock:
                self._stopping = True
            report_error(str(exc))
            self._finish(EXIT_FAULT)
            return
        where = exception_location(exc)
        kind = LOST if where.in_collective or _is_dist_error(exc) else ERROR
        if kind == ERROR:  # the root cause: its traceback is worth one print
            traceback.print_exception(exc, file=sys.stderr)
        self._stop(self._entry(kind, where, _describe(exc)), EXIT_FAULT)

    def leaving(self, code: int) -> None:
        """Every rank agreed to exit with `code` (a user error): a stop signal from now on means the
        launcher is ending the ranks that have not left yet (torchrun SIGTERMs the others as soon as
        one rank exits), so it exits with the same code instead of reporting a signal."""
        self._leaving_code = code

    def on_signal(self, signum: int) -> None:
        if self._leaving_code is not None:
            self._exit(self._leaving_code)
            return
        name = signal.Signals(signum).name
        self._stop(self._entry(SIGNAL, self._main_location(), name), 128 + signum)

    def on_timeout(self, phase: Phase, seconds: float) -> None:
        """Neither this rank nor any peer moved for `seconds` (> the phase's timeout): the job is stuck."""
        message = f"no progress in any rank for {seconds:.1f} s > dist_timeout_s={phase.timeout_s:g}"
        self._stop(self._entry(TIMEOUT, self._main_location(), message), EXIT_FAULT)

    def on_peer_post(self) -> None:
        self._stop(self._entry(PEER, self._main_location(), "another rank posted a fault"), EXIT_FAULT)

    def on_peer_silent(self, rank: int, seconds: float) -> None:
        """This rank waits, and `rank`'s heartbeat stopped: dead or frozen (a GPU collective never tells)."""
        self._stop(self._entry(LOST, self._main_location(), f"rank {rank} sent no heartbeat for {seconds:.1f} s"),
                   EXIT_FAULT)

    def on_board_lost(self, exc: BaseException) -> None:
        """The store (on rank 0, unless torchrun's agent holds it) is gone: fatal unless this rank is
        just finishing normally, or its main thread notices the loss itself and stops first."""
        self.board = None
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and self.progress.phase.name != IDLE and not self._stopping:
            time.sleep(POLL_S)
        if self.progress.phase.name == IDLE:
            return
        self._stop(self._entry(LOST, self._main_location(), f"rendezvous store unreachable: {_describe(exc)}"),
                   EXIT_FAULT)

    # --- stopping -----------------------------------------------------------------------
    def _main_location(self) -> Location:
        return thread_location(self._main)

    def _entry(self, kind: str, where: Location, message: str) -> FaultEntry:
        phase, now, dog = self.progress.phase, time.monotonic(), self.watchdog
        seconds = min(dog.stalled_s(now), phase.elapsed(now)) if dog is not None else phase.elapsed(now)
        return FaultEntry(self.ranks.rank, kind, phase.step, phase.name, round(seconds, 2),
                          phase.timeout_s, where.where, where.in_collective or phase.issued, message)

    def _stop(self, entry: FaultEntry, code: int) -> None:
        with self._lock:
            first = not self._stopping
            self._stopping = True
        if not first:  # another thread is already stopping this process
            if threading.current_thread() is self._main:
                while True:
                    time.sleep(1)
            return
        if self.watchdog is not None:
            self.watchdog.halt()
        try:
            self._conclude(entry)
        except BaseException as exc:  # noqa: BLE001 - still exit, and still say why
            report_error(f"rank {entry.rank} stopped ({entry.kind}: {entry.message}); the fault report "
                         f"failed: {_describe(exc)}")
        finally:
            self._finish(code)

    def _conclude(self, own: FaultEntry) -> None:
        """Post `own`; rank 0 gathers the posts and reports, the others wait for that report (and
        ack it, so rank 0, which may host the store, outlives their reads). If rank 0 stays silent one
        survivor reports; if the store is gone (it lived on rank 0) this rank reports alone."""
        rank, world = self.ranks.rank, self.ranks.world_size
        if world == 1:
            report_error(summarize_faults({rank: own}, 1, own))
            return
        board, rank0_alive = self.board, False
        try:
            if board is None or not board.reachable():
                raise ConnectionError("the rendezvous store is unreachable")
            board.post(own)
            if rank == 0:
                entries = self._wait_for(lambda: len(board.entries()) == world, board.entries)
                report_error(summarize_faults(entries, world, own, last_seen=_last_seen(board, entries)))
                board.mark_reported()
                others = [r for r in board.entries() if r != 0]
                self._wait_for(lambda: board.all_acked(others), lambda: None)
                return
            rank0_alive = self._wait_for(lambda: board.is_reported() or board.has_entry(0),
                                         lambda: board.has_entry(0))
            if rank0_alive:
                self._wait_for(board.is_reported, lambda: None)
            elif board.claim_report():
                entries = board.entries()
                report_error(summarize_faults(entries, world, own, last_seen=_last_seen(board, entries)))
                board.mark_reported()
            board.ack(rank)
        except Exception:  # noqa: BLE001 - the store is gone; it lived on rank 0, so rank 0 is gone
            if not rank0_alive:
                report_error(summarize_faults({rank: own}, world, own, store_lost=rank != 0))

    def _wait_for(self, done: Callable[[], bool], result: Callable[[], object]):
        deadline = time.monotonic() + self.grace_s
        while not done() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return result()

    def _finish(self, code: int) -> None:
        for hook in list(self._exit_hooks):
            try:
                hook()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        self._exit(code)


def _last_seen(board: FaultBoard, entries: dict[int, FaultEntry]) -> dict[int, dict]:
    """The published locations of the ranks that did not post (they are dead or frozen)."""
    seen = {}
    for rank in range(board.world_size):
        if rank not in entries and (where := board.last_seen(rank)) is not None:
            seen[rank] = where
    return seen


def _is_dist_error(exc: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(exc, dist.DistError)
