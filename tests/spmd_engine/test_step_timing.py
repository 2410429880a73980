import pytest

import spmd_engine.telemetry.step_timing as step_timing
from spmd_engine.telemetry.step_timing import PHASES, PhaseClock, StepTimer


def phases(**values):
    return {p: values.get(p, 0.0) for p in PHASES}


def test_summary_splits_decode_and_prefill_and_the_full_batch():
    timer = StepTimer()
    timer.add(2, 900, False, **phases(schedule=0.001, forward=0.009))
    timer.add(4, 4, True, **phases(schedule=0.001, broadcast=0.0005, inputs=0.0005, sample=0.008))
    timer.add(4, 4, True, **phases(schedule=0.001, broadcast=0.0005, inputs=0.0005, sample=0.008))
    timer.add(1, 1, True, **phases(sample=0.002))
    s = timer.summary()
    assert s["steps"] == 4 and s["all"]["steps"] == 4
    assert s["prefill_or_mixed"]["step_ms"] == pytest.approx(10.0)
    full = s["decode_max_batch"]
    assert full["steps"] == 2 and full["mean_seqs"] == 4
    assert full["step_ms"] == pytest.approx(10.0) and full["host_plan_ms"] == pytest.approx(2.0)
    assert full["host_plan_fraction"] == pytest.approx(0.2)
    assert s["decode"]["steps"] == 3


def test_every_phase_is_required():
    with pytest.raises(ValueError, match="exactly the phases"):
        StepTimer().add(1, 1, True, schedule=0.1)
    assert StepTimer().summary() == {"steps": 0}


def test_gpu_idle_is_summarised_over_the_steps_that_have_it():
    timer = StepTimer()
    for _ in range(3):
        timer.add(8, 8, True, **phases(wait=0.008, schedule=0.002))
    timer.set_gpu_idle([0.5, 1.5, None])  # the last step has no successor to measure against
    full = timer.summary()["decode_max_batch"]
    assert full["gpu_idle_ms"] == pytest.approx(1.0)
    assert full["gpu_idle_fraction"] == pytest.approx(2.0 / 20.0)
    assert full["host_plan_fraction"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="2 GPU idle times for 3 steps"):
        timer.set_gpu_idle([0.1, 0.2])
    assert "gpu_busy_ms" not in full


def test_gpu_busy_is_each_kinds_gpu_time_per_step():
    """The GPU time of a step's forward + sampling, by step kind: under async scheduling the host
    clocks charge a step's GPU work to whichever later step waits for it."""
    timer = StepTimer()
    timer.add(8, 8, True, **phases(wait=0.008))
    timer.add(8, 40, False, num_decode_seqs=7, **phases(wait=0.001))
    timer.add(8, 8, True, **phases(wait=0.008))
    timer.set_gpu_idle([0.1, 0.2, None], [4.0, 9.0, None])
    summary = timer.summary()
    assert summary["decode"]["gpu_busy_ms"] == pytest.approx(4.0)
    assert summary["mixed"]["gpu_busy_ms"] == pytest.approx(9.0)
    with pytest.raises(ValueError, match="1 GPU busy times for 3 steps"):
        timer.set_gpu_idle([0.1, 0.2, None], [1.0])


def test_a_phase_clock_charges_every_gap_to_the_next_lap_and_sums_repeated_phases(monkeypatch):
    ticks = iter([10.0, 10.5, 11.0, 13.0, 13.25])
    monkeypatch.setattr(step_timing.time, "perf_counter", lambda: next(ticks))
    clock = PhaseClock()  # starts at 10.0
    clock.lap("wait")
    clock.lap("sample")
    clock.lap("forward")
    clock.lap("sample")  # the step's second sampling (synchronous scheduling) adds to the first
    assert clock.seconds == phases(wait=0.5, sample=0.75, forward=2.0)
    timer = StepTimer()
    timer.add(1, 1, True, **clock.seconds)
    assert timer.summary()["all"]["step_ms"] == pytest.approx(3250.0)


def test_take_hands_a_step_its_phases_and_the_next_step_the_time_since(monkeypatch):
    ticks = iter([0.0, 1.0, 3.0, 3.5, 4.0, 4.25, 7.0])
    monkeypatch.setattr(step_timing.time, "perf_counter", lambda: next(ticks))
    clock = PhaseClock()  # starts at 0.0
    clock.lap("wait")
    clock.lap("forward")
    assert clock.take() == phases(wait=1.0, forward=2.0)
    clock.lap("postprocess")  # 3.0 -> 3.5: the gap after the take, charged to the next step
    clock.lap("wait")  # a turn that launched nothing: not taken, so the next take holds it
    clock.lap("postprocess")
    clock.lap("forward")
    assert clock.take() == phases(postprocess=0.75, wait=0.5, forward=2.75)
    assert clock.take() == phases()


def test_mixed_and_pure_prefill_steps_apart_with_their_launch_kinds():
    timer = StepTimer()
    timer.add(200, 1000, False, num_decode_seqs=190, launch="piecewise_graph", **phases(forward=0.006))
    timer.add(200, 9000, False, num_decode_seqs=190, launch="eager", **phases(forward=0.010))
    timer.add(8, 4000, False, num_decode_seqs=0, launch="eager", **phases(forward=0.020))
    timer.add(200, 200, True, num_decode_seqs=200, launch="decode_graph", **phases(forward=0.001))
    s = timer.summary()
    assert s["mixed"]["steps"] == 2 and s["mixed"]["step_ms"] == pytest.approx(8.0)
    assert s["mixed"]["launches"] == {"piecewise_graph": 1, "eager": 1}
    assert s["prefill"]["steps"] == 1 and s["prefill"]["launches"] == {"eager": 1}
    assert s["prefill_or_mixed"]["steps"] == 3 and s["decode"]["launches"] == {"decode_graph": 1}
    with pytest.raises(ValueError, match="launch must be one of"):
        timer.add(1, 1, True, launch="graph", **phases())


def test_replicas_step_timing_merges_to_the_timing_of_all_their_steps():
    """metrics.json's engine.step_timing with dp > 1 (`merge_step_timing`): the same means as one timer
    over every replica's steps; the largest decode batch only where a replica reached it."""
    import random

    from spmd_engine.job.metrics import merge_step_timing, replicas_engine

    rng = random.Random(0)
    timers, everything = [StepTimer(), StepTimer()], StepTimer()
    for r, timer in enumerate(timers):
        for i in range(7 + 5 * r):
            decode = i % 3 != 0
            seqs = rng.randint(1, 3 + r) if decode else 2
            step = (seqs, rng.randint(1, 99), decode)
            kw = dict(num_decode_seqs=rng.randint(0, 1) if not decode else seqs,
                      launch=rng.choice(["eager", "decode_graph"]), **phases(**{p: rng.random() / 100 for p in PHASES}))
            timer.add(*step, **kw)
            everything.add(*step, **kw)
    merged, whole = merge_step_timing([t.summary() for t in timers]), everything.summary()
    assert merged["steps"] == whole["steps"] == 19
    for kind in ("all", "decode", "prefill_or_mixed", "mixed", "prefill", "decode_max_batch"):
        assert set(merged[kind]) == set(whole[kind]) - {"step_p50_ms"}, kind
        for key, value in merged[kind].items():
            assert value == pytest.approx(whole[kind][key]), (kind, key)
    runs = [{"steps": len(t), "decode_steps": sum(t.is_decode), "preemptions": r, "cached_prompt_tokens": 3,
             "async_scheduling": True, "step_timing": t.summary()} for r, t in enumerate(timers)]
    engine = replicas_engine(runs)
    assert (engine["steps"], engine["preemptions"], engine["cached_prompt_tokens"]) == (19, 1, 6)
    assert engine["decode_steps"] == sum(everything.is_decode)
    assert [r["replica"] for r in engine["per_replica"]] == [0, 1]
    assert replicas_engine(runs[:1]) == runs[0]  # one replica: its figures as they are
