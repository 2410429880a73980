"""Watchdog: a thread that ends this rank when its step stalls, a peer dies, or a peer posts a fault.

Why: a hang inside a collective or a replayed CUDA graph escapes NCCL's own watchdog, a rank
blocked in a gloo wait never sees that its peer already gave up, and NCCL never notices a dead
peer at all (its collective just waits). So every poll this thread beats a heartbeat into the
rendezvous store and looks for posts; while its own step is slow it also watches the peers'
heartbeats. If even this thread cannot run (the main thread holds the GIL inside C code),
faulthandler's C-level timer, re-armed on every poll, dumps every thread's stack and exits.
"""
from __future__ import annotations

import faulthandler
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from spmd_engine.fault_board import FaultBoard
from spmd_engine.progress import Phase, StepProgress

OBSERVE_AFTER_S = 1.0  # a watched phase this old makes the peers' heartbeats worth reading
STALE_S = 5.0  # a peer whose heartbeat count stood still this long is dead or frozen


@dataclass(frozen=True)
class WatchdogCallbacks:
    """What the watchdog calls (at most one of them, once; then the thread ends)."""

    on_timeout: Callable[[Phase], None]  # the main thread's phase ran past its timeout
    on_peer_post: Callable[[], None]  # another rank posted on the fault board
    on_board_lost: Callable[[BaseException], None]  # the rendezvous store stopped answering
    on_peer_silent: Callable[[int, float], None] | None = None  # (rank, seconds) its heartbeat stopped


class Watchdog:
    def __init__(self, progress: StepProgress, board: FaultBoard | None, callbacks: WatchdogCallbacks,
                 rank: int = 0, poll_s: float = 0.25, deadman_margin_s: float = 30.0,
                 observe_after_s: float = OBSERVE_AFTER_S, stale_s: float = STALE_S) -> None:
        self.progress = progress
        self.board = board
        self.callbacks = callbacks
        self.rank = rank
        self.poll_s = poll_s
        self.deadman_margin_s = deadman_margin_s
        self.observe_after_s = observe_after_s
        self.stale_s = stale_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spmd-watchdog", daemon=True)
        self._deadman_armed = False
        self._seen: dict[int, tuple[int, float]] = {}  # peer -> (heartbeat count, when it last changed)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def halt(self) -> None:
        """Stop polling soon (any thread; no join): the rank is stopping anyway."""
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._disarm_deadman()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.check_once():
                return

    def check_once(self) -> bool:
        """One poll; True when a callback fired (the rank is stopping)."""
        phase = self.progress.phase
        now = time.monotonic()
        if phase.overdue(now):
            self._disarm_deadman()
            self.callbacks.on_timeout(phase)
            return True
        if self.board is not None and not self._stop.is_set():
            try:
                self.board.beat(self.rank)
                posted = self.board.has_posts()
                silent = None if posted else self._silent_peer(phase, now)
            except Exception as exc:  # noqa: BLE001 - any store failure means the store host is gone
                self._disarm_deadman()
                self.callbacks.on_board_lost(exc)
                return True
            if posted:
                self._disarm_deadman()
                self.callbacks.on_peer_post()
                return True
            if silent is not None and self.callbacks.on_peer_silent is not None:
                self._disarm_deadman()
                self.callbacks.on_peer_silent(*silent)
                return True
        self._rearm_deadman(phase, now)
        return False

    def _silent_peer(self, phase: Phase, now: float) -> tuple[int, float] | None:
        """(rank, seconds) of a peer whose heartbeat stood still while this rank's step is slow."""
        if phase.timeout_s is None or phase.elapsed(now) < self.observe_after_s:
            self._seen.clear()
            return None
        stale_s = min(self.stale_s, phase.timeout_s / 2)
        for rank, count in enumerate(self.board.beats()):
            if rank == self.rank:
                continue
            last = self._seen.get(rank)
            if last is None or last[0] != count:
                self._seen[rank] = (count, now)
            elif now - last[1] >= stale_s:
                return rank, now - last[1]
        return None

    def _rearm_deadman(self, phase: Phase, now: float) -> None:
        """While a phase is watched: if this thread stops polling, the C timer ends the process."""
        if phase.timeout_s is None:
            self._disarm_deadman()
            return
        left = max(0.0, phase.timeout_s - phase.elapsed(now))
        try:
            faulthandler.dump_traceback_later(left + self.deadman_margin_s, repeat=False, file=sys.stderr,
                                              exit=True)
        except (AttributeError, OSError, ValueError):  # stderr has no file descriptor: no deadman
            return
        self._deadman_armed = True

    def _disarm_deadman(self) -> None:
        if self._deadman_armed:
            faulthandler.cancel_dump_traceback_later()
            self._deadman_armed = False
