import pickle
import random

import numpy as np
import pytest

from spmd_engine.core.plan import COMMAND_STOP, PlanBuilder, StepPlan
from spmd_engine.executor.block_table import BlockTableMirror
from spmd_engine.core.scheduler import Scheduler, SchedulerConfig
from spmd_engine.core.sequence import SamplingParams, Sequence


def make(**overrides) -> Scheduler:
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=12, max_model_len=32, block_size=4, num_blocks=10,
               enable_prefix_caching=True)
    cfg.update(overrides)
    return Scheduler(SchedulerConfig(**cfg), eos_token_ids={0})


def test_plan_fields_follow_the_schedule():
    sched, builder = make(), PlanBuilder()
    a = Sequence(3, [11, 12, 13, 14, 15, 16, 17], SamplingParams(max_tokens=5))
    b = Sequence(8, [21, 22, 23, 24, 25, 26], SamplingParams(max_tokens=5))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()  # a: 7 tokens, b: first 5 of 6
    plan = builder.build(out, step=0)
    assert plan.step == 0 and plan.command == "forward" and plan.num_seqs == 2 and plan.num_tokens == 12
    assert plan.seq_ids.tolist() == [3, 8] and plan.seq_ids.dtype == np.int64
    assert plan.num_computed.tolist() == [0, 0] and plan.query_lens.tolist() == [7, 5]
    assert plan.input_ids.tolist() == [11, 12, 13, 14, 15, 16, 17, 21, 22, 23, 24, 25]
    assert plan.sample.tolist() == [True, False] and not plan.is_decode
    assert plan.reset_tables.tolist() == [True, True] and plan.new_block_counts.tolist() == [2, 2]
    assert plan.new_block_ids.tolist() == a.block_table + b.block_table
    assert plan.dropped_seq_ids.tolist() == []

    sched.postprocess(out, {3: 99})
    out = sched.schedule()  # a decodes token 99 at position 7 (block 1), b its last prompt token
    plan = builder.build(out, step=1)
    assert plan.num_computed.tolist() == [7, 5] and plan.query_lens.tolist() == [1, 1]
    assert plan.input_ids.tolist() == [99, 26] and plan.is_decode
    assert plan.reset_tables.tolist() == [False, False] and plan.new_block_counts.tolist() == [0, 0]
    assert plan.new_block_ids.size == 0


def test_finished_and_preempted_are_dropped_once():
    sched, builder = make(), PlanBuilder()
    a = Sequence(1, [5, 6], SamplingParams(max_tokens=1))
    sched.add(a)
    out = sched.schedule()
    builder.build(out, 0)
    sched.postprocess(out, {1: 7})
    assert a.finish_reason == "length" and builder.num_tracked == 1
    assert builder.build(sched.schedule(), 1) is None  # nothing to run: the drop waits for the next plan
    assert builder.num_tracked == 0 and builder.num_unsent_drops == 1
    b = Sequence(3, [8, 9])
    sched.add(b)
    plan = builder.build(sched.schedule(), 2)
    assert plan.seq_ids.tolist() == [3] and plan.dropped_seq_ids.tolist() == [1] and builder.num_unsent_drops == 0
    mirror = BlockTableMirror(8, 4)
    assert mirror.apply(plan).shape == (1, 8)
    # a request that never reached a plan is not sent as dropped
    sched.add(Sequence(2, [1, 2]))
    assert sched.abort(2)
    assert builder.build(sched.schedule(), 3).dropped_seq_ids.tolist() == []


def test_stop_plan_drops_every_table_still_held():
    sched, builder, mirror = make(), PlanBuilder(), BlockTableMirror(8, 4)
    for i in range(3):
        sched.add(Sequence(i, [1, 2, 3]))
    mirror.apply(builder.build(sched.schedule(), 0))
    assert mirror.num_tables == 3
    plan = builder.stop_plan(41)
    assert plan.command == COMMAND_STOP and plan.step == 41 and plan.num_seqs == 0
    assert sorted(plan.dropped_seq_ids.tolist()) == [0, 1, 2] and builder.num_tracked == 0
    mirror.apply(plan)
    assert mirror.num_tables == 0


def test_mirror_rejects_a_table_it_never_saw():
    mirror = BlockTableMirror(4, 4)
    plan = StepPlan(step=5, seq_ids=np.array([9]), num_computed=np.array([4], np.int32),
                    query_lens=np.array([1], np.int32), input_ids=np.array([1], np.int32),
                    sample=np.array([True]), reset_tables=np.array([False]),
                    new_block_counts=np.array([0], np.int32))
    with pytest.raises(RuntimeError, match="seq 9 has no block table"):
        mirror.apply(plan)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_mirror_tracks_scheduler_tables_through_preemption(seed):
    rng = random.Random(seed)
    sched = make(max_num_seqs=rng.randint(2, 5), max_num_batched_tokens=rng.randint(4, 16),
                 num_blocks=rng.randint(8, 12))
    max_blocks = sched.config.max_blocks_per_seq
    builder, mirror = PlanBuilder(), BlockTableMirror(max_blocks, sched.config.block_size)
    # a pickled round trip stands in for broadcast_object_list
    reqs = [Sequence(i, [rng.randrange(1, 9) for _ in range(rng.randint(1, 14))],
                     SamplingParams(max_tokens=rng.randint(1, 18), ignore_eos=True)) for i in range(30)]
    pending, step = list(reqs), 0
    while pending or sched.has_unfinished():
        if pending and rng.random() < 0.6:
            sched.add(pending.pop(0))
        out = sched.schedule()
        plan = builder.build(out, step)
        if plan is None:  # nothing to run: only more requests can come
            assert pending, "the scheduler made no progress"
            continue
        plan = pickle.loads(pickle.dumps(plan))
        tables = mirror.apply(plan)
        assert tables.shape == (out.num_seqs, max_blocks) and tables.dtype == np.int32
        for row, s in zip(tables, out.seqs):
            n = len(s.block_table)
            assert row[:n].tolist() == s.block_table and not row[n:].any()
        expected_inputs = [t for s, c, q in zip(out.seqs, out.num_computed_before, out.num_new_tokens)
                           for t in s.token_ids[c : c + q]]
        assert plan.input_ids.tolist() == expected_inputs
        assert mirror.num_tables == builder.num_tracked
        sched.postprocess(out, {int(i): rng.randrange(1, 9) for i, smp in zip(plan.seq_ids, plan.sample) if smp})
        step += 1
        assert step < 5000
    assert sched.num_preemptions > 0
    assert builder.build(sched.schedule(), step) is None
    mirror.apply(builder.stop_plan(step))  # the last finishes are dropped too
    assert mirror.num_tables == 0 and builder.num_tracked == 0


def test_decode_plan_at_batch_256_is_small():
    sched = make(max_num_seqs=256, max_num_batched_tokens=2048, block_size=16, num_blocks=512)
    builder = PlanBuilder()
    for i in range(256):
        sched.add(Sequence(1000 + i, [1, 2, 3], SamplingParams(max_tokens=8)))
    out = sched.schedule()
    builder.build(out, 0)
    sched.postprocess(out, {s.seq_id: 5 for s in out.seqs})
    plan = builder.build(sched.schedule(), 1)
    assert plan.is_decode and plan.num_seqs == 256 and plan.new_block_ids.size == 0
    size = len(pickle.dumps(plan))
    assert size < 8 * 1024, size


def test_inputs_still_being_sampled_are_deferred_to_the_previous_steps_rows():
    sched, builder = make(max_num_batched_tokens=16), PlanBuilder()
    a = Sequence(3, [11, 12, 13], SamplingParams(max_tokens=5))
    b = Sequence(8, [21, 22, 23, 24, 25, 26, 27, 28, 29], SamplingParams(max_tokens=5))
    c = Sequence(9, [31, 32], SamplingParams(max_tokens=5))
    for s in (a, b, c):
        sched.add(s)
    first = builder.build(sched.schedule(), step=0)  # a: 3, b: 9, c: 2 tokens (14 of 16)
    assert first.sample.tolist() == [True, True, True] and first.deferred_positions.size == 0
    second = builder.build(sched.schedule(), step=1)  # every input is a token step 0 is still sampling
    assert second.input_ids.tolist() == [0, 0, 0]
    assert second.deferred_positions.tolist() == [0, 1, 2] and second.deferred_rows.tolist() == [0, 1, 2]
    assert second.num_prev_sampled == 3


def test_known_and_deferred_inputs_mix_in_one_plan():
    sched, builder = make(max_num_batched_tokens=8), PlanBuilder()
    a = Sequence(3, [11, 12, 13], SamplingParams(max_tokens=5))
    b = Sequence(8, [21, 22, 23, 24, 25, 26, 27, 28, 29], SamplingParams(max_tokens=5))
    sched.add(a)
    sched.add(b)
    first_out = sched.schedule()  # a: 3 (samples), b: 5 of 9 (no sample)
    builder.build(first_out, step=0)
    second = builder.build(sched.schedule(), step=1)  # a: its pending token, b: its last 4 prompt tokens
    assert second.input_ids.tolist() == [0, 26, 27, 28, 29]
    assert second.deferred_positions.tolist() == [0] and second.deferred_rows.tolist() == [0]
    assert second.num_prev_sampled == 1
    sched.postprocess(first_out, {3: 77})
    third = builder.build(sched.schedule(), step=2)  # a's token 77 is known now; the step-1 ones are not
    assert third.input_ids.tolist() == [0, 0] and third.deferred_rows.tolist() == [0, 1]


def _self_preempting_schedule(prefix_caching: bool):
    """Async scheduling's corner: the one sequence that can run needs a block, the pool is full, so it
    preempts itself while the other waits for its pending last token; the schedule runs nothing."""
    sched = make(max_num_batched_tokens=32, num_blocks=8, enable_prefix_caching=prefix_caching)
    builder = PlanBuilder()
    a = Sequence(1, [5, 6, 7], SamplingParams(max_tokens=1))
    b = Sequence(2, list(range(10, 38)), SamplingParams(max_tokens=4))  # 28 tokens: 7 blocks
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    plan = builder.build(first, 0)
    assert plan.seq_ids.tolist() == [1, 2] and plan.sample.tolist() == [True, True]
    sent_b = list(b.block_table)
    second = sched.schedule()  # step 0 still in flight: a ends with its pending token, b needs block 8
    assert second.is_empty and [s.seq_id for s in second.preempted] == [2]
    return sched, builder, plan, first, second, sent_b


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_schedule_that_runs_nothing_sends_its_preemption_with_the_next_plan(prefix_caching):
    sched, builder, first_plan, first, second, _ = _self_preempting_schedule(prefix_caching)
    mirror = BlockTableMirror(8, 4)
    mirror.apply(first_plan)
    assert builder.build(second, 1) is None and builder.num_unsent_drops == 1
    sched.postprocess(first, {1: 50, 2: 51})  # a finishes (length); b is readmitted below
    third = sched.schedule()
    plan = builder.build(third, 2)
    assert sorted(plan.dropped_seq_ids.tolist()) == [1, 2]
    assert plan.seq_ids.tolist() == [2] and plan.reset_tables.tolist() == [True]
    b = third.seqs[0]
    mirror.apply(plan)
    assert mirror.tables() == {2: b.block_table}


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_drop_that_never_reached_the_plans_stops_the_job_naming_the_sequence(prefix_caching):
    """The always-on check: had the engine skipped the empty schedule (as it once did), readmitting b
    would have sent a delta on a table the scheduler freed; the builder refuses instead."""
    sched, builder, _, first, _, _ = _self_preempting_schedule(prefix_caching)
    # the empty schedule is lost here: its preemption of seq 2 never reaches the builder
    sched.postprocess(first, {1: 50, 2: 51})
    with pytest.raises(RuntimeError, match=r"step 2: seq 2: the ranks' block table \(7 blocks.*stale.*"
                                           r"preempted 1 time"):
        builder.build(sched.schedule(), 2)


def test_mirror_rejects_a_table_that_does_not_cover_the_step():
    mirror = BlockTableMirror(4, 4)
    plan = StepPlan(step=3, seq_ids=np.array([7, 9]), num_computed=np.array([0, 0], np.int32),
                    query_lens=np.array([4, 5], np.int32), input_ids=np.arange(9, dtype=np.int32),
                    sample=np.array([True, True]), reset_tables=np.array([True, True]),
                    new_block_counts=np.array([1, 1], np.int32), new_block_ids=np.array([2, 3], np.int32))
    with pytest.raises(RuntimeError, match=r"step 3: seq 9: this rank's block table holds 1 blocks.* 5 tokens"):
        mirror.apply(plan)


def test_mirror_rows_are_reused_and_grown_without_stale_blocks():
    """The mirror keeps every table in one array (a row per sequence, rows reused after a drop, the array
    grown past its first rows): a reused or reset row must read back zero padded, never a dropped
    sequence's blocks, and every step's tables must equal the tables sent."""
    max_blocks, rng = 6, random.Random(7)
    mirror, model = BlockTableMirror(max_blocks, 4), {}
    for step in range(60):
        dropped = [sid for sid in list(model) if rng.random() < 0.3]
        for sid in dropped:
            del model[sid]
        seq_ids = rng.sample(range(80), rng.randint(1, 40))  # up to 40 tables: past the first 16 rows
        resets, counts, new_ids = [], [], []
        for sid in seq_ids:
            reset = sid not in model or rng.random() < 0.1  # new, or readmitted after a preemption
            if reset:
                model[sid] = []
            count = rng.randint(1 if not model[sid] else 0, max_blocks - len(model[sid]))
            blocks = [rng.randrange(1, 1000) for _ in range(count)]
            model[sid] += blocks
            resets.append(reset)
            counts.append(count)
            new_ids += blocks
        plan = StepPlan(step=step, seq_ids=np.array(seq_ids, np.int64), num_computed=np.zeros(len(seq_ids), np.int32),
                        query_lens=np.ones(len(seq_ids), np.int32), input_ids=np.zeros(len(seq_ids), np.int32),
                        sample=np.ones(len(seq_ids), bool), reset_tables=np.array(resets),
                        new_block_counts=np.array(counts, np.int32), new_block_ids=np.array(new_ids, np.int32),
                        dropped_seq_ids=np.array(dropped, np.int64))
        tables = mirror.apply(plan)
        expected = np.array([model[sid] + [0] * (max_blocks - len(model[sid])) for sid in seq_ids], np.int32)
        assert tables.dtype == np.int32 and np.array_equal(tables, expected), step
        assert mirror.tables() == model and mirror.num_tables == len(model)
