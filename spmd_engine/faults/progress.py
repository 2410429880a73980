"""StepProgress: what this rank's main thread is doing right now, stamped by the step loop.

Why: a rank stuck inside a collective or a CUDA graph cannot report itself, so the step loop only
stamps its phase (one small object per step) and the watchdog thread judges, from outside, when
it is late.
"""
from __future__ import annotations

import time
from typing import NamedTuple

STARTUP = "startup"  # building the engine; rank 0 reading and tokenizing requests
WAIT_PLAN = "wait_plan"  # a rank other than 0 waiting for the next StepPlan
STEP = "step"  # one engine step (rank 0: schedule, broadcast, forward, sample, postprocess)
IDLE = "idle"  # between generate calls


class Phase(NamedTuple):
    """One immutable snapshot; the watchdog thread reads it without a lock."""

    name: str
    step: int | None  # the step being run (STEP) or the last one run (WAIT_PLAN)
    since: float  # time.monotonic() when the phase began
    timeout_s: float | None  # None: not watched (start-up, the first plan of a generate call, idle)
    issued: bool = False  # rank 0: this step's forward (and its collectives) is issued; it waits for results

    def elapsed(self, now: float) -> float:
        return now - self.since


class StepProgress:
    """Written by the main thread only; `timeout_s` is the job's dist_timeout_s (None: never watched)."""

    def __init__(self, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self._phase = Phase(STARTUP, None, time.monotonic(), None)
        self._last_step: int | None = None

    @property
    def phase(self) -> Phase:
        return self._phase

    def step(self, step: int) -> None:
        """A step begins (rank 0 before it schedules, other ranks once the plan arrived)."""
        self._last_step = step
        self._phase = Phase(STEP, step, time.monotonic(), self.timeout_s)

    def forward_issued(self) -> None:
        """Rank 0 now waits for the step's results: on a GPU, waiting here means waiting for the peers'
        share of the collectives, even though no torch.distributed call is on the stack."""
        self._phase = self._phase._replace(issued=True)

    def wait_plan(self, first: bool) -> None:
        """Another rank waits for a plan; the first one of a generate call is not watched, since rank 0
        may still be reading prompts, tokenizing or warming up."""
        self._phase = Phase(WAIT_PLAN, self._last_step, time.monotonic(), None if first else self.timeout_s)

    def idle(self) -> None:
        self._phase = Phase(IDLE, self._last_step, time.monotonic(), None)
