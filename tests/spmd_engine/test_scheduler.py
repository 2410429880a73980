import logging
import random
from collections import Counter

import numpy as np
import pytest

from spmd_engine.core.scheduler import ScheduleOutput, Scheduler, SchedulerConfig
from spmd_engine.core.sequence import SamplingParams, Sequence, SequenceStatus

EOS = 0
VOCAB = 23


def make(**overrides) -> Scheduler:
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32, block_size=4, num_blocks=32,
               enable_prefix_caching=True)
    cfg.update(overrides)
    return Scheduler(SchedulerConfig(**cfg), eos_token_ids={EOS})


def seq(seq_id: int, n: int, max_tokens: int = 16, ignore_eos: bool = True, first: int = 1) -> Sequence:
    return Sequence(seq_id, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))


def rows(out: ScheduleOutput) -> list[tuple[int, int, int, bool]]:
    return [(s.seq_id, c, n, smp)
            for s, c, n, smp in zip(out.seqs, out.num_computed_before, out.num_new_tokens, out.sample)]


def fixed_token_step(sched: Scheduler, token: int = 5):
    out = sched.schedule()
    return out, sched.postprocess(out, {s.seq_id: token for s, smp in zip(out.seqs, out.sample) if smp})


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_num_seqs", 0, "max_num_seqs must be an integer >= 1, got 0"),
        ("block_size", 1.5, "block_size must be an integer >= 1, got 1.5"),
        ("num_blocks", 7, "the KV pool must hold ceil(max_model_len / block_size) = 8 blocks so one "
                          "full-length sequence fits, got num_blocks=7"),
    ],
)
def test_config_validation(field, value, message):
    with pytest.raises(ValueError) as err:
        make(**{field: value})
    assert str(err.value) == message


def test_add_rejects_too_long_prompt_and_duplicate_id():
    sched = make()
    with pytest.raises(ValueError, match="more than max_model_len=32"):
        sched.add(seq(0, 33))
    sched.add(seq(1, 32))
    with pytest.raises(ValueError, match="already in flight"):
        sched.add(seq(1, 3))


def test_chunked_prefill_of_several_sequences_mixed_with_decodes():
    sched = make(max_num_batched_tokens=8)
    for i in range(3):
        sched.add(seq(i, 10, first=10 * i + 1))
    out, _ = fixed_token_step(sched)
    assert rows(out) == [(0, 0, 8, False)]
    out, _ = fixed_token_step(sched)
    assert rows(out) == [(0, 8, 2, True), (1, 0, 6, False)]
    out, _ = fixed_token_step(sched)
    assert rows(out) == [(0, 10, 1, True), (1, 6, 4, True), (2, 0, 3, False)]
    out, _ = fixed_token_step(sched)
    assert rows(out) == [(0, 11, 1, True), (1, 10, 1, True), (2, 3, 6, False)]
    assert sched.num_running == 3 and sched.num_waiting == 0
    assert sched.running[0].token_ids[-3:] == [5, 5, 5]


def test_prompt_tokens_of_a_step_with_decodes_are_capped():
    """max_prompt_tokens_per_mixed_step: once a sequence decodes, prefill chunks and admissions share
    the cap (decodes do not count); a step without decodes still takes the whole token budget."""
    sched = make(max_num_batched_tokens=16, max_prompt_tokens_per_mixed_step=5)
    for i in range(3):
        sched.add(seq(i, 10, first=10 * i + 1))
    out, _ = fixed_token_step(sched)
    assert rows(out) == [(0, 0, 10, True), (1, 0, 6, False)]  # nothing decodes yet: the token budget
    out, _ = fixed_token_step(sched)
    assert rows(out) == [(0, 10, 1, True), (1, 6, 4, True), (2, 0, 1, False)]
    out, _ = fixed_token_step(sched)
    assert rows(out) == [(0, 11, 1, True), (1, 10, 1, True), (2, 1, 5, False)]
    out, _ = fixed_token_step(sched)
    assert rows(out) == [(0, 12, 1, True), (1, 11, 1, True), (2, 6, 4, True)]


def test_a_prefill_ahead_of_a_decode_takes_the_cap_and_admission_waits():
    sched = make(max_num_batched_tokens=16, max_prompt_tokens_per_mixed_step=3)
    sched.add(seq(0, 2))
    fixed_token_step(sched)
    sched.add(seq(1, 12, first=30))
    sched.add(seq(2, 12, first=50))
    out, _ = fixed_token_step(sched)
    assert rows(out) == [(0, 2, 1, True), (1, 0, 3, False)]
    sched.running.reverse()  # a prefill ahead of a decode (as after a preemption's readmission)
    out, _ = fixed_token_step(sched)
    assert rows(out) == [(1, 3, 3, False), (0, 3, 1, True)] and sched.num_waiting == 1
    with pytest.raises(ValueError, match="max_prompt_tokens_per_mixed_step must be an integer >= 1 or None"):
        make(max_prompt_tokens_per_mixed_step=0)


def test_decode_gets_its_slot_before_the_forward():
    sched = make()
    sched.add(seq(0, 4))
    out, _ = fixed_token_step(sched)
    s = out.seqs[0]
    assert len(s.block_table) == 1 and s.num_tokens == 5
    out = sched.schedule()
    assert rows(out) == [(0, 4, 1, True)]
    assert len(s.block_table) == 2  # position 4 (the token sampled last step) needs a second block


def test_seq_budget_and_fcfs_admission():
    sched = make(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(seq(i, 3, first=10 * i + 1))
    out, _ = fixed_token_step(sched)
    assert [s.seq_id for s in out.seqs] == [0, 1]
    assert sched.num_waiting == 1


def test_admission_stops_when_blocks_run_out():
    sched = make(num_blocks=8, max_num_batched_tokens=64, max_num_seqs=8)
    sched.add(seq(0, 20))  # 5 blocks
    sched.add(seq(1, 16, first=50))  # 4 blocks: does not fit beside seq 0
    sched.add(seq(2, 2, first=90))  # would fit, but FCFS: it waits behind seq 1
    out, _ = fixed_token_step(sched)
    assert [s.seq_id for s in out.seqs] == [0]
    assert [s.seq_id for s in sched.waiting] == [1, 2]
    assert sched.waiting[0].block_table == [] and sched.block_manager.num_free_blocks == 3


def test_preemption_recomputes_and_everything_finishes():
    sched = make(num_blocks=8, max_num_batched_tokens=64)
    a, b = seq(0, 12, max_tokens=12), seq(1, 12, max_tokens=12, first=40)
    sched.add(a)
    sched.add(b)
    preempted = []
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out, _ = fixed_token_step(sched)
        assert out.num_seqs <= 4 and out.num_tokens <= 64
        for p in out.preempted:
            assert p.block_table == [] and p.num_computed_tokens == 0 and p.status is SequenceStatus.WAITING
            assert sched.waiting[0] is p or p in sched.waiting
            preempted.append(p.seq_id)
    assert not sched.has_unfinished()
    assert preempted and preempted[0] == 1  # the most recently admitted goes first
    assert b.num_preemptions >= 1
    for s in (a, b):
        assert s.output_token_ids == [5] * 12 and s.finish_reason == "length"
    assert sched.block_manager.num_free_blocks == 8


def test_preempted_sequence_goes_to_the_front_and_recomputes_generated_tokens():
    sched = make(num_blocks=8, max_num_batched_tokens=64)
    a, b, c = seq(0, 14), seq(1, 14, first=40), seq(2, 2, first=80)
    for s in (a, b, c):
        sched.add(s)
    out, _ = fixed_token_step(sched)
    assert [s.seq_id for s in out.seqs] == [0, 1]  # 4 blocks each: the pool is full, c waits
    for _ in range(2):  # decodes at positions 14, 15 still fit in block 3
        out, _ = fixed_token_step(sched)
        assert not out.preempted
    out = sched.schedule()  # a writes position 16: a 5th block, taken from b
    assert [p.seq_id for p in out.preempted] == [1] and [s.seq_id for s in out.seqs] == [0]
    assert [s.seq_id for s in sched.waiting] == [1, 2]
    assert (b.num_tokens, b.num_computed_tokens, b.block_table, b.num_preemptions) == (17, 0, [], 1)
    sched.postprocess(out, {0: 5})
    while a.status is SequenceStatus.RUNNING:
        fixed_token_step(sched)
    out = sched.schedule()
    assert [s.seq_id for s in out.seqs] == [1, 2]
    assert rows(out)[0] == (1, b.num_cached_tokens, 17 - b.num_cached_tokens, True)


@pytest.mark.parametrize(
    "prompt_len, params, sampled, reason, n_out",
    [
        (20, SamplingParams(max_tokens=10), [3, EOS], "stop", 2),
        (20, SamplingParams(max_tokens=10, ignore_eos=True), [EOS] * 10, "length", 10),
        (20, SamplingParams(max_tokens=3), [4, 4, 4], "length", 3),
        (28, SamplingParams(max_tokens=100), [4] * 4, "length", 4),  # max_model_len 32
        (32, SamplingParams(max_tokens=100), [4], "length", 1),
    ],
)
def test_stop_conditions(prompt_len, params, sampled, reason, n_out):
    sched = make()
    s = Sequence(0, list(range(1, prompt_len + 1)), params)
    sched.add(s)
    finished = []
    for token in sampled:
        out = sched.schedule()
        while not out.sample[0]:
            sched.postprocess(out, {})
            out = sched.schedule()
        finished = sched.postprocess(out, {0: token})
    assert finished == [s] and s.finish_reason == reason and s.num_output_tokens == n_out
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == 32
    assert sched.schedule().finished_seq_ids == [0]
    assert sched.schedule().finished_seq_ids == []


def test_abort_waiting_and_running():
    sched = make(max_num_seqs=1)
    a, b = seq(0, 3), seq(1, 3, first=50)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert sched.abort(1) and b.finish_reason == "abort"
    assert sched.abort(0) and not sched.abort(0)
    assert sched.postprocess(out, {0: 7}) == [] and a.num_output_tokens == 0
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == 32
    assert sorted(sched.schedule().finished_seq_ids) == [0, 1]


def test_debug_log_per_step(caplog):
    sched = make()
    sched.add(seq(0, 5))
    with caplog.at_level(logging.DEBUG, logger="spmd_engine.core.scheduler"):
        sched.schedule()
    assert "1 seqs" in caplog.text and "5 tokens" in caplog.text


# --- seeded random simulation with a fake model whose "KV cache" stores token ids -------------


def next_token(context: list[int]) -> int:
    """A deterministic 'model': the next token is a function of the whole context."""
    return (sum((i + 1) * t for i, t in enumerate(context)) * 7 + len(context)) % VOCAB


def reference_output(prompt: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    tokens = list(prompt)
    while True:
        t = next_token(tokens)
        tokens.append(t)
        n_out = len(tokens) - len(prompt)
        if (t == EOS and not params.ignore_eos) or n_out >= params.max_tokens or len(tokens) >= max_model_len:
            return tokens[len(prompt):]


class FakeKVModel:
    """Writes each computed token into its paged slot and reads the context back through the table."""

    def __init__(self, sched: Scheduler) -> None:
        cfg = sched.config
        self.bm = sched.block_manager
        self.bs = cfg.block_size
        self.kv_token = np.full(cfg.num_blocks * cfg.block_size, -1)
        self.kv_pos = np.full(cfg.num_blocks * cfg.block_size, -1)

    def slot(self, s: Sequence, pos: int) -> int:
        return s.block_table[pos // self.bs] * self.bs + pos % self.bs

    def forward(self, out: ScheduleOutput) -> dict[int, int]:
        for s, start, n in zip(out.seqs, out.num_computed_before, out.num_new_tokens):
            for pos in range(start, start + n):
                block_id = s.block_table[pos // self.bs]
                assert self.bm.blocks[block_id].ref_count == 1, "writing into a shared block"
                assert not self.bm.is_cached(block_id), "writing into a cached block"
                self.kv_token[self.slot(s, pos)], self.kv_pos[self.slot(s, pos)] = s.token_ids[pos], pos
        sampled = {}
        for s, start, n, smp in zip(out.seqs, out.num_computed_before, out.num_new_tokens, out.sample):
            slots = [self.slot(s, p) for p in range(start + n)]
            assert self.kv_pos[slots].tolist() == list(range(start + n))
            context = self.kv_token[slots].tolist()
            assert context == s.token_ids[: start + n]
            if smp:
                sampled[s.seq_id] = next_token(context)
        return sampled


def check_invariants(sched: Scheduler, out: ScheduleOutput) -> None:
    cfg, bm = sched.config, sched.block_manager
    assert out.num_seqs <= cfg.max_num_seqs and out.num_tokens <= cfg.max_num_batched_tokens
    assert len({s.seq_id for s in out.seqs}) == out.num_seqs
    assert all(n >= 1 for n in out.num_new_tokens)
    holders = Counter(b for s in sched.running for b in s.block_table)
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
    assert bm.num_free_blocks == sum(1 for b in bm.blocks if b.ref_count == 0)
    assert bm.num_free_blocks + bm.num_used_blocks == cfg.num_blocks
    for block_id, count in holders.items():
        if count > 1:  # shared: must be a computed full prefix block of every holder
            assert bm.blocks[block_id].hash is not None
            for s in sched.running:
                if block_id in s.block_table:
                    assert (s.block_table.index(block_id) + 1) * cfg.block_size <= s.num_computed_tokens
    for s in sched.waiting:
        assert s.block_table == [] and s.status is SequenceStatus.WAITING
    for s in sched.running:
        assert len(s.block_table) <= cfg.max_blocks_per_seq and s.status is SequenceStatus.RUNNING
    for s, start, n in zip(out.seqs, out.num_computed_before, out.num_new_tokens):
        assert len(s.block_table) * cfg.block_size >= start + n


def random_requests(rng: random.Random, count: int, max_model_len: int) -> list[Sequence]:
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    reqs = []
    for i in range(count):
        prompt = list(rng.choice(prefixes)) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 6))]
        params = SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.5)
        reqs.append(Sequence(i, prompt[:max_model_len], params))
    return reqs


@pytest.mark.parametrize("cap", [False, True])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_simulation_keeps_invariants_and_finishes(seed, prefix_caching, cap):
    rng = random.Random(seed)
    sched = make(max_num_seqs=rng.randint(2, 6), max_num_batched_tokens=rng.randint(3, 20),
                 num_blocks=rng.randint(8, 14), enable_prefix_caching=prefix_caching)
    model = FakeKVModel(sched)
    reqs = random_requests(rng, 40, sched.config.max_model_len)
    if cap:  # its own draw: the other seeds' schedules stay as they were
        sched.config.max_prompt_tokens_per_mixed_step = random.Random(seed).randint(1, 6)
    pending = list(reqs)
    finished = []
    for _step in range(3000):
        for _ in range(rng.randint(0, 2)):
            if pending:
                sched.add(pending.pop(0))
        if not pending and not sched.has_unfinished():
            break
        out = sched.schedule()
        check_invariants(sched, out)
        finished += sched.postprocess(out, model.forward(out))
    assert not pending and not sched.has_unfinished()
    assert sorted(s.seq_id for s in finished) == list(range(len(reqs)))
    for s in reqs:
        assert s.output_token_ids == reference_output(s.prompt_token_ids, s.params, sched.config.max_model_len)
    assert sched.block_manager.num_free_blocks == sched.config.num_blocks
    assert sched.num_preemptions > 0
    if prefix_caching:
        assert sched.block_manager.prefix_cache_hits > 0


# --- async scheduling: the next step is planned before this one's tokens are read back ----------

def test_next_step_is_planned_before_the_tokens_arrive():
    sched = make(max_num_batched_tokens=32)
    a, b = seq(0, 5), seq(1, 3)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert rows(first) == [(0, 0, 5, True), (1, 0, 3, True)]
    assert (a.num_computed_tokens, a.num_pending_tokens, a.num_planned_tokens) == (5, 1, 6)
    second = sched.schedule()  # the first step's tokens are still on the device
    assert rows(second) == [(0, 5, 1, True), (1, 3, 1, True)]
    assert a.num_pending_tokens == 2 and a.num_tokens == 5
    assert sched.postprocess(first, {0: 7, 1: 8}) == []
    assert a.token_ids[-1] == 7 and a.num_pending_tokens == 1
    third = sched.schedule()
    assert rows(third) == [(0, 6, 1, True), (1, 4, 1, True)]
    sched.postprocess(second, {0: 9, 1: 9})
    assert a.output_token_ids == [7, 9] and a.num_pending_tokens == 1


def test_a_pending_last_token_is_not_planned_again():
    sched = make()
    short, longer = seq(0, 3, max_tokens=1), seq(1, 3, max_tokens=4)
    sched.add(short)
    sched.add(longer)
    first = sched.schedule()
    second = sched.schedule()  # `short` ends with its pending token: only `longer` runs
    assert rows(second) == [(1, 3, 1, True)]
    assert sched.postprocess(first, {0: 5, 1: 5}) == [short]
    assert short.finish_reason == "length" and short.output_token_ids == [5]


def test_a_speculative_step_after_eos_is_dropped():
    sched = make()
    s = seq(0, 3, ignore_eos=False)
    sched.add(s)
    first = sched.schedule()
    second = sched.schedule()  # planned before anyone knows the first token is EOS
    assert rows(second) == [(0, 3, 1, True)]
    assert sched.postprocess(first, {0: EOS}) == [s]
    assert sched.postprocess(second, {0: 5}) == []  # its token is thrown away
    assert s.output_token_ids == [EOS] and s.finish_reason == "stop"
    assert not sched.has_unfinished() and sched.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("token, finished", [(5, False), (EOS, True)])
def test_preempted_with_a_pending_token_waits_for_it(token, finished):
    sched = make(max_num_batched_tokens=32, num_blocks=8)  # 2 x 16-token prompts fill the pool
    a, b = seq(0, 16), seq(1, 16, ignore_eos=False)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    second = sched.schedule()  # a needs a 5th block: b is preempted while its token is pending
    assert rows(second) == [(0, 16, 1, True)] and second.preempted == [b]
    assert (b.status, b.num_computed_tokens, b.num_pending_tokens, b.block_table) == (SequenceStatus.WAITING, 0, 1, [])
    assert sched.postprocess(first, {0: 5, 1: token}) == ([b] if finished else [])
    assert b.num_pending_tokens == 0 and b.output_token_ids == [token]
    assert (b in sched.waiting) != finished
    if not finished:  # readmitted later, recomputing its prompt and the token that arrived
        sched.postprocess(second, {0: 5})
        while b.status is not SequenceStatus.RUNNING:
            out, _ = fixed_token_step(sched)
        assert b.num_computed_tokens == 17


@pytest.mark.parametrize("min_tokens", [0, 4])
def test_a_stop_string_given_at_admission_finishes_the_sequence(min_tokens):
    """The scheduler follows a request's text itself (the OutputText given to `add`): the token that
    completes a stop string finishes it, none before min_tokens; it asks its caller nothing."""
    from spmd_engine.core.detokenizer import OutputText

    sched = make()
    params = SamplingParams(max_tokens=8, ignore_eos=True, stop=["cd"], min_tokens=min_tokens)
    s = Sequence(0, [1, 2, 3], params)
    sched.add(s, stop_text=OutputText(lambda ids: "".join(chr(ord("a") + t) for t in ids), [], ["cd"], False))
    finished = []
    for token in [1, 2, 3, 2, 3, 4]:  # b c d c d e: "cd" completes at the 3rd token, again at the 5th
        out = sched.schedule()
        finished += sched.postprocess(out, {0: token})
        if finished:
            break
    assert finished == [s] and s.finish_reason == "stop" and s.stop_reason == "cd"
    assert s.num_output_tokens == (3 if min_tokens == 0 else 5)
    assert not sched.has_unfinished() and sched._stop_texts == {}
