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


def test_without_a_timeout_no_phase_is_watched():
    unwatched = StepProgress(timeout_s=None)
    unwatched.step(0)
    assert unwatched.phase.timeout_s is None
    unwatched.wait_plan(first=False)
    assert unwatched.phase.timeout_s is None
