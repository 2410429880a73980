import time

from spmd_engine.faults.progress import IDLE, STARTUP, STEP, WAIT_PLAN, StepProgress


def test_phases_carry_step_and_timeout():
    p = StepProgress(timeout_s=5.0)
    assert p.phase.name == STARTUP and p.phase.timeout_s is None
    p.step(7)
    assert (p.phase.name, p.phase.step, p.phase.timeout_s) == (STEP, 7, 5.0)
    p.forward_issued()  # rank 0 waits for results: on a GPU that is waiting for the peers
    assert (p.phase.name, p.phase.step, p.phase.issued) == (STEP, 7, True)
    p.wait_plan(first=False)
    assert (p.phase.name, p.phase.step, p.phase.timeout_s) == (WAIT_PLAN, 7, 5.0)
    p.wait_plan(first=True)  # rank 0 may still be tokenizing: not watched
    assert p.phase.timeout_s is None
    p.idle()
    assert (p.phase.name, p.phase.timeout_s) == (IDLE, None)


def test_overdue_only_when_watched_and_late():
    p = StepProgress(timeout_s=10.0)
    p.step(0)
    now = time.monotonic()
    assert not p.phase.overdue(now) and p.phase.overdue(now + 10.5)
    p.idle()
    assert not p.phase.overdue(now + 1e6)
    unwatched = StepProgress(timeout_s=None)
    unwatched.step(0)
    assert not unwatched.phase.overdue(now + 1e6)
