"""SIGINT/SIGTERM handled on a thread of their own, so they work while the main thread is blocked.

Why: Python runs signal handlers on the main thread between bytecodes, and a main thread waiting
inside a gloo or NCCL collective may not get there for minutes. Python's C-level handler still
writes the signal number to the wakeup fd at once; a reader thread acts on it.
"""
from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class SignalThread:
    """Installed handlers; `uninstall` puts the previous ones back (tests; a process keeps them)."""

    signals: tuple[int, ...]
    previous: dict[int, object] = field(default_factory=dict)
    previous_wakeup_fd: int = -1
    read_fd: int = -1
    write_fd: int = -1
    thread: threading.Thread | None = None

    def uninstall(self) -> None:
        signal.set_wakeup_fd(self.previous_wakeup_fd)
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        os.close(self.write_fd)  # the reader sees end of file and returns
        if self.thread is not None:
            self.thread.join(timeout=5)
        os.close(self.read_fd)


def _ignore(signum, frame) -> None:
    """The Python-level handler must exist for the wakeup fd to be written; the thread does the work."""


def install_signal_thread(on_signal: Callable[[int], None],
                          signals: Iterable[int] = STOP_SIGNALS) -> SignalThread:
    """Call `on_signal(signum)` on a daemon thread for each of `signals`; main thread only."""
    state = SignalThread(tuple(signals))
    state.read_fd, state.write_fd = os.pipe()
    os.set_blocking(state.write_fd, False)
    for signum in state.signals:
        state.previous[signum] = signal.signal(signum, _ignore)
    state.previous_wakeup_fd = signal.set_wakeup_fd(state.write_fd, warn_on_full_buffer=False)

    def read_signals() -> None:
        while True:
            data = os.read(state.read_fd, 64)
            if not data:
                return
            for signum in data:
                if signum in state.signals:
                    on_signal(signum)

    state.thread = threading.Thread(target=read_signals, name="spmd-signals", daemon=True)
    state.thread.start()
    return state
