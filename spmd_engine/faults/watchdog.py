"""Watchdog: a thread that ends this rank when the job stops moving, a peer dies, or a peer posts a fault.

Why: a hang inside a collective or a replayed CUDA graph escapes NCCL's own watchdog, a rank
blocked in a gloo wait never sees that its peer already gave up, and NCCL never notices a dead
peer at all (its collective just waits). But a step that is merely long (an 8192-token prefill on
a busy CPU) is not a hang, so the rule is about progress, not about how old a step is:

- every poll the thread samples its main thread: it *moved* if its phase changed (a new step, a
  plan arrived, a forward was issued), or if it computed since the last poll: it used CPU and is not
  waiting on its peers (not inside torch.distributed, not waiting for a plan, not waiting for an
  issued forward). In a process that uses CUDA its stack must also differ from the last poll's: a
  host spinning in a CUDA wait uses CPU in one place, while on a CPU device one op may compute for
  seconds;
- each move adds one to the rank's progress count in the rendezvous store (next to a heartbeat the
  thread beats on every poll, and the rank's last location);
- a rank is hung only when, for more than `dist_timeout_s`, neither it nor any peer moved (one rank
  stopped outside the collective the others wait in, all wait in mismatched collectives, ...); a
  peer whose heartbeat stands still for 5 s (or `dist_timeout_s/2`) is dead or frozen.

If even this thread cannot run (the main thread holds the GIL inside C code), faulthandler's C-level
timer, re-armed on every poll, dumps every thread's stack and exits.
"""
from __future__ import annotations

import faulthandler
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from spmd_engine.faults.fault_board import FaultBoard
from spmd_engine.faults.progress import WAIT_PLAN, Phase, StepProgress
from spmd_engine.faults.stack_location import Location, thread_snapshot

OBSERVE_AFTER_S = 1.0  # a watched phase this old makes the peers' heartbeats and progress worth reading
STALE_S = 5.0  # a peer whose heartbeat count stood still this long is dead or frozen
MIN_CPU_SHARE = 0.02  # main-thread CPU per second of polling that counts as computing (a sleeping thread: ~0)


@dataclass(frozen=True)
class MainSample:
    """The main thread seen from the watchdog thread: its CPU time so far, where it is, its stack's key."""

    cpu_s: float
    location: Location
    stack_key: int = 0


def _cpu_clock(thread: threading.Thread) -> Callable[[], float]:
    """`thread`'s own CPU clock (Linux); elsewhere the process's CPU time less the calling thread's."""
    try:
        clock = time.pthread_getcpuclockid(thread.ident)
        time.clock_gettime(clock)
        return lambda: time.clock_gettime(clock)
    except (AttributeError, OSError, TypeError):
        return lambda: time.process_time() - time.thread_time()


def uses_cuda() -> bool:
    """Whether this process has initialized CUDA (then the host's CPU time may be spin-waiting)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def main_thread_probe() -> Callable[[], MainSample]:
    main = threading.main_thread()
    cpu = _cpu_clock(main)

    def sample() -> MainSample:
        location, key = thread_snapshot(main)
        return MainSample(cpu(), location, key)

    return sample


@dataclass(frozen=True)
class WatchdogCallbacks:
    """What the watchdog calls (at most one of them, once; then the thread ends)."""

    on_timeout: Callable[[Phase, float], None]  # (phase, seconds) nothing in the job moved for longer than allowed
    on_peer_post: Callable[[], None]  # another rank posted on the fault board
    on_board_lost: Callable[[BaseException], None]  # the rendezvous store stopped answering
    on_peer_silent: Callable[[int, float], None] | None = None  # (rank, seconds) its heartbeat stopped


class Watchdog:
    def __init__(self, progress: StepProgress, board: FaultBoard | None, callbacks: WatchdogCallbacks,
                 rank: int = 0, poll_s: float = 0.25, deadman_margin_s: float = 30.0,
                 observe_after_s: float = OBSERVE_AFTER_S, stale_s: float = STALE_S,
                 probe: Callable[[], MainSample] | None = None,
                 spin_waits: Callable[[], bool] = uses_cuda) -> None:
        self.progress = progress
        self.board = board
        self.callbacks = callbacks
        self.rank = rank
        self.poll_s = poll_s
        self.deadman_margin_s = deadman_margin_s
        self.observe_after_s = observe_after_s
        self.stale_s = stale_s
        self.probe = probe or main_thread_probe()
        self.spin_waits = spin_waits
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spmd-watchdog", daemon=True)
        self._deadman_armed = False
        first = self.probe()
        self._last_phase: Phase | None = None
        self._last_cpu = first.cpu_s
        self._last_key = first.stack_key
        self._last_poll = time.monotonic()
        self._last_move = self._last_poll
        self._published: tuple | None = None
        self._beats: dict[int, tuple[int, float]] = {}  # peer -> (heartbeat count, when it last changed)
        self._moves: dict[int, tuple[int, float]] = {}  # peer -> (progress count, when it last changed)

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

    def stalled_s(self, now: float | None = None) -> float:
        """Seconds since this rank's main thread last moved (phase change or computing)."""
        return (time.monotonic() if now is None else now) - self._last_move

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.check_once():
                return

    def check_once(self) -> bool:
        """One poll; True when a callback fired (the rank is stopping)."""
        phase = self.progress.phase
        now = time.monotonic()
        sample = self.probe()
        moved = self._moved(phase, sample, now)
        if moved:
            self._last_move = now
        stalled = now - self._last_move
        watched = phase.timeout_s is not None and phase.elapsed(now) >= self.observe_after_s
        peers_still = self.board is None  # no peers known: this rank's own stall decides
        if self.board is not None and not self._stop.is_set():
            try:
                self.board.beat(self.rank)
                if moved:
                    self.board.moved(self.rank)
                self._publish(phase, sample.location)
                posted = self.board.has_posts()
                silent, peers_still = (None, False) if posted else self._watch_peers(phase, now, watched)
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
        if phase.timeout_s is not None and stalled > phase.timeout_s and peers_still:
            self._disarm_deadman()
            self.callbacks.on_timeout(phase, stalled)
            return True
        self._rearm_deadman(phase, stalled)
        return False

    def _moved(self, phase: Phase, sample: MainSample, now: float) -> bool:
        """Did the main thread make progress since the last poll? A new phase, or computing: CPU spent
        outside waits on the peers (and, where waits may spin, a different stack)."""
        changed = phase is not self._last_phase
        cpu = sample.cpu_s - self._last_cpu
        interval = now - self._last_poll
        other_stack = sample.stack_key != self._last_key
        self._last_phase, self._last_cpu, self._last_poll = phase, sample.cpu_s, now
        self._last_key = sample.stack_key
        waiting = sample.location.in_collective or phase.name == WAIT_PLAN or phase.issued
        if changed:
            return True
        if waiting or cpu < MIN_CPU_SHARE * interval:
            return False
        return other_stack or not self.spin_waits()

    def _publish(self, phase: Phase, where: Location) -> None:
        """Where this rank is, for the report if it freezes (only when it changed: one store write)."""
        state = (phase.step, phase.name, where.where, where.in_collective)
        if state != self._published:
            self.board.publish(self.rank, *state)
            self._published = state

    def _watch_peers(self, phase: Phase, now: float, watched: bool) -> tuple[tuple[int, float] | None, bool]:
        """While this rank's phase is watched and not brand new: (a peer whose heartbeat stood still,
        whether every peer's progress stood still for longer than the phase's timeout)."""
        if not watched:
            self._beats.clear()
            self._moves.clear()
            return None, False
        stale_s = min(self.stale_s, phase.timeout_s / 2)
        silent, still = None, True
        for rank, (beats, moves) in enumerate(zip(self.board.beats(), self.board.moves())):
            if rank == self.rank:
                continue
            if _changed(self._beats, rank, beats, now) >= stale_s and silent is None:
                silent = rank, now - self._beats[rank][1]
            if _changed(self._moves, rank, moves, now) <= phase.timeout_s:
                still = False
        return silent, still

    def _rearm_deadman(self, phase: Phase, stalled: float) -> None:
        """While a phase is watched: if this thread stops polling, the C timer ends the process."""
        if phase.timeout_s is None:
            self._disarm_deadman()
            return
        left = max(0.0, phase.timeout_s - stalled)
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


def _changed(seen: dict[int, tuple[int, float]], rank: int, count: int, now: float) -> float:
    """Record `rank`'s counter; seconds since it last changed (as far as this rank has watched)."""
    last = seen.get(rank)
    if last is None or last[0] != count:
        seen[rank] = (count, now)
        return 0.0
    return now - last[1]
