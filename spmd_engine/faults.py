"""Test-only fault injection, so the tests can prove that a failing rank never hangs the job.

Enabled with `+fault.rank=R +fault.step=S +fault.kind=raise|exit|kill|hang` on the command line;
every rank gets the same config and only rank R acts, just before step S's forward.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

FAULT_KINDS = ("raise", "exit", "kill", "hang")


class InjectedFault(RuntimeError):
    """Raised by the `raise` fault kind."""


@dataclass(frozen=True)
class FaultInjector:
    rank: int | None = None
    step: int = 0
    kind: str = "raise"

    @classmethod
    def from_config(cls, fault: dict | None, my_rank: int) -> "FaultInjector":
        if not fault:
            return cls()
        kind = str(fault.get("kind", "raise"))
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault.kind must be one of {'|'.join(FAULT_KINDS)}, got {kind!r}")
        rank = int(fault.get("rank", 0))
        return cls(rank if rank == my_rank else None, int(fault.get("step", 0)), kind)

    def before_step(self, step: int) -> None:
        if self.rank is None or step != self.step:
            return
        if self.kind == "raise":
            raise InjectedFault(f"injected fault on rank {self.rank} at step {step}")
        if self.kind == "exit":
            os._exit(3)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang
            time.sleep(1)
