"""Test-only fault injection, so the tests can prove that a failing rank never hangs the job.

Enabled with `+fault.rank=R +fault.step=S +fault.kind=raise|exit|kill|hang|slow` on the command line;
every rank gets the same config and only rank R acts (R=-1: every rank), just before step S's forward.
`slow` computes (burns CPU in torch ops, as a long forward does) for `+fault.seconds=N`: a slow step,
which must not be taken for a hang. `+fault.kind=slow_start +fault.seconds=N` instead makes rank R
sleep N seconds before its requests are read (rank 0: as if tokenizing a huge prompts file), which
must not time the others out.

Not an engine key: the Hydra job reads `fault` from the composed config, builds each rank's injector
and installs it on the engine's runner (spmd_engine/job/hydra_job.py).
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

STEP_KINDS = ("raise", "exit", "kill", "hang", "slow")
FAULT_KINDS = (*STEP_KINDS, "slow_start")
EVERY_RANK = -1


class InjectedFault(RuntimeError):
    """Raised by the `raise` fault kind."""


@dataclass(frozen=True)
class FaultInjector:
    rank: int | None = None
    step: int = 0
    kind: str = "raise"
    seconds: float = 0.0

    @classmethod
    def from_config(cls, fault: dict | None, my_rank: int) -> "FaultInjector":
        if not fault:
            return cls()
        kind = str(fault.get("kind", "raise"))
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault.kind must be one of {'|'.join(FAULT_KINDS)}, got {kind!r}")
        rank = int(fault.get("rank", 0))
        return cls(my_rank if rank in (my_rank, EVERY_RANK) else None, int(fault.get("step", 0)), kind,
                   float(fault.get("seconds", 0.0)))

    def install(self, runner) -> None:
        """Test hook: with a step fault configured for this rank, the runner's `launch` acts it out
        just before step S's forward; otherwise the runner is left untouched (no call per step)."""
        if self.rank is None or self.kind not in STEP_KINDS:
            return
        launch = runner.launch

        def launch_with_fault(staged, prev_tokens=None):
            self.before_step(staged.plan.step)
            return launch(staged, prev_tokens)

        runner.launch = launch_with_fault

    def before_requests(self) -> None:
        if self.rank is not None and self.kind == "slow_start":
            time.sleep(self.seconds)

    def before_step(self, step: int) -> None:
        if self.rank is None or step != self.step or self.kind not in STEP_KINDS:
            return
        if self.kind == "raise":
            raise InjectedFault(f"injected fault on rank {self.rank} at step {step}")
        if self.kind == "exit":
            os._exit(3)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "slow":
            compute_for(self.seconds)
            return
        while True:  # hang
            time.sleep(1)


def compute_for(seconds: float) -> int:
    """Keep this thread computing for `seconds` as a forward does: CPU-bound ops, one after another
    (a host spinning in one place is a wait, not progress, to the watchdog). Returns the rounds run."""
    import torch

    x = torch.randn(96, 96, generator=torch.Generator().manual_seed(0))
    end = time.monotonic() + seconds
    rounds = 0
    while time.monotonic() < end:
        x = torch.tanh(x @ x)
        x = torch.sigmoid(x @ x.T)
        x = torch.softmax(x @ x, dim=-1)
        rounds += 1
    return rounds
