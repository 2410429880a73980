import time
import types

import pytest

from spmd_engine.faults.injection import FaultInjector, InjectedFault


def test_only_the_named_rank_acts_at_the_named_step():
    cfg = {"rank": 1, "step": 3, "kind": "raise"}
    FaultInjector.from_config(cfg, my_rank=0).before_step(3)  # other rank: nothing
    mine = FaultInjector.from_config(cfg, my_rank=1)
    mine.before_step(2)
    with pytest.raises(InjectedFault, match="rank 1 at step 3"):
        mine.before_step(3)
    assert FaultInjector.from_config(None, 0).rank is None


def test_slow_start_sleeps_before_requests_only():
    slow = FaultInjector.from_config({"rank": 0, "kind": "slow_start", "seconds": 0.2}, my_rank=0)
    slow.before_step(0)  # not a step fault
    t0 = time.monotonic()
    slow.before_requests()
    assert time.monotonic() - t0 >= 0.2


def test_unknown_kind_is_one_line():
    with pytest.raises(ValueError, match="fault.kind must be one of raise"):
        FaultInjector.from_config({"kind": "explode"}, 0)


def test_slow_computes_on_every_rank_when_rank_is_minus_one(monkeypatch):
    # "computed, did not sleep" is checked by forbidding sleep and counting the compute rounds, not
    # by CPU time: on a loaded 2-core CI machine this thread may get only a fraction of the wall time.
    import spmd_engine.faults.injection as injection

    rounds = []
    compute_for = injection.compute_for
    monkeypatch.setattr(injection, "compute_for", lambda s: rounds.append(compute_for(s)))
    no_sleep = types.SimpleNamespace(monotonic=time.monotonic, sleep=lambda s: pytest.fail(f"slow slept {s} s"))
    monkeypatch.setattr(injection, "time", no_sleep)  # the module's clock only, not the process's
    cfg = {"rank": -1, "step": 2, "kind": "slow", "seconds": 0.3}
    for rank in (0, 1, 2):
        slow = FaultInjector.from_config(cfg, my_rank=rank)
        assert slow.rank == rank
        t0 = time.monotonic()
        slow.before_step(2)
        assert time.monotonic() - t0 >= 0.3 and len(rounds) == rank + 1 and rounds[-1] >= 1
    assert FaultInjector.from_config({**cfg, "rank": 1}, my_rank=0).rank is None
