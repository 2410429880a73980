"""The engine's own step loop (rank 0's `StepLoop.run`) with a fake runner: every rank's block-table
mirror must equal the scheduler's tables whenever a forward could read them, whatever the loop does.

A schedule that runs nothing (async scheduling: every running sequence waits for the step in flight)
can still preempt a sequence; the loop once skipped such schedules, the drop never reached the plans,
and the readmitted sequence ran on stale KV blocks. This drives the real loop (scheduler, plan builder,
async pipelining, sampler) over long runs with tiny KV pools and chunked prefill, in-process: the
model is replaced by random logits and the other ranks by mirrors that apply each broadcast plan
after a pickle round trip, as `_follow_plans` does.
"""
from __future__ import annotations

import pickle
import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spmd_engine.engine as engine_module
from spmd_engine.config import EngineConfig, ModelConfig, WorkloadConfig
from spmd_engine.core.sequence import SamplingParams
from spmd_engine.core.plan import COMMAND_STOP, StepPlan
from spmd_engine.executor.block_table import BlockTableMirror
from spmd_engine.faults.progress import StepProgress
from spmd_engine.job.prompts import PromptRequest
from spmd_engine.step_loop import GenerateCall, LoopParts, StepLoop

VOCAB, EOS = 6, 1  # a tiny vocabulary: greedy tokens on random logits hit EOS now and then
NUM_OTHER_RANKS = 2


@dataclass
class FakeStaged:
    """ModelRunner's StagedStep as the engine sees it."""

    plan: StepPlan
    launch_kind: str = "eager"


class FakeRunner:
    """Stands in for ModelRunner on rank 0: applies each plan to rank 0's mirror, checks every mirror
    against the scheduler, and returns random logits for the sampled rows."""

    def __init__(self, num_blocks: int, max_blocks: int, block_size: int, seed: int) -> None:
        self.num_blocks = num_blocks
        self.mirror = BlockTableMirror(max_blocks, block_size)
        self.others = [BlockTableMirror(max_blocks, block_size) for _ in range(NUM_OTHER_RANKS)]
        self.logits = torch.Generator().manual_seed(seed)
        self.last_prompt_logits: torch.Tensor | None = None  # no request here asks for prompt logprobs
        self.sampler_graphs = None  # no sampler graphs (as on CPU)
        self.scheduler = None  # the generation's, set once it exists
        self.checked_steps = 0
        self.idle_preemptions = 0
        self.schedules: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # (seq ids, new tokens) per schedule
        self.fed_at_schedule: list[int] = []  # requests admitted before each schedule

    def broadcast(self, plan: StepPlan) -> StepPlan:
        """What broadcast_object does for the other ranks: each gets its own unpickled copy."""
        for mirror in self.others:
            mirror.apply(pickle.loads(pickle.dumps(plan)))
        return plan

    def stage(self, plan: StepPlan) -> FakeStaged:
        self.mirror.apply(plan)
        expected = {s.seq_id: list(s.block_table) for s in self.scheduler.running}
        for rank, mirror in enumerate([self.mirror, *self.others]):
            assert mirror.tables() == expected, f"step {plan.step}: rank {rank}'s tables differ from the scheduler's"
        self.checked_steps += 1
        return FakeStaged(plan)

    def apply_stop(self, plan: StepPlan) -> None:
        self.mirror.apply(plan)

    def sampler_graph_rows(self, staged: FakeStaged) -> int | None:
        return None  # no sampler graphs (as on CPU): every step samples eagerly

    def launch(self, staged: FakeStaged, prev_tokens: torch.Tensor | None) -> torch.Tensor | None:
        plan = staged.plan
        if plan.num_prev_sampled:
            assert prev_tokens is not None and prev_tokens.shape[0] >= plan.num_prev_sampled
        rows = int(plan.sample.sum())
        return torch.randn(rows, VOCAB, generator=self.logits) if rows else None


def run_loop(prompts: list[list[int]], max_tokens: list[int], *, block_size: int, num_blocks: int,
             max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int, prefix_caching: bool,
             async_scheduling: bool, seed: int = 0, ignore_eos: bool = False,
             feed=lambda requests: requests, on_finish=None) -> tuple[FakeRunner, StepLoop]:
    cfg = EngineConfig(model=ModelConfig("fake", None, "dummy", {}), workload=WorkloadConfig("chat"),
                       sampling=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=ignore_eos),
                       block_size=block_size, num_kv_blocks=num_blocks, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                       enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling, device="cpu")
    runner = FakeRunner(num_blocks, -(-max_model_len // block_size), block_size, seed)
    scheduler = engine_module.new_scheduler(cfg, max_model_len, num_blocks, [EOS])
    stops: list[StepPlan] = []

    def broadcast(plan: StepPlan) -> StepPlan:
        if plan.command == COMMAND_STOP:
            stops.append(plan)
        return runner.broadcast(plan)

    replica = SimpleNamespace(broadcast_object=broadcast)  # the replica's plan channel
    parts = LoopParts(cfg, scheduler, runner, replica, StepProgress(), torch.device("cpu"), VOCAB, max_model_len)
    requests = [PromptRequest(i, None, p, {"max_tokens": m}) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    gen = StepLoop(parts, GenerateCall.of(feed(requests), on_finish), 0)
    runner.scheduler = gen.scheduler
    schedule = gen.scheduler.schedule

    def counting_schedule():  # schedules that run nothing yet preempt: the case the loop once lost
        runner.fed_at_schedule.append(gen.fed)
        out = schedule()
        runner.idle_preemptions += int(out.is_empty and bool(out.preempted))
        runner.schedules.append((tuple(s.seq_id for s in out.seqs), tuple(out.num_new_tokens)))
        return out

    gen.scheduler.schedule = counting_schedule
    outs = gen.run()
    assert [o.error for o in outs] == [None] * len(prompts)
    for out, limit in zip(outs, max_tokens):
        assert 1 <= len(out.token_ids) <= limit and out.finish_reason in ("stop", "length")
        assert out.finish_reason == "length" or out.token_ids[-1] == EOS
    assert len(stops) == 1 and all(m.num_tables == 0 for m in [runner.mirror, *runner.others])
    assert gen.scheduler.block_manager.num_used_blocks == 0
    return runner, gen


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_self_preempting_idle_schedule_reaches_every_mirror(prefix_caching):
    """The case from the issue, made small: one sequence grows into a full pool and preempts itself
    while the other waits for its last pending token, in a schedule that runs nothing."""
    runner, gen = run_loop([[2, 3, 4], list(range(2, 6)) * 7], [1, 4], block_size=4, num_blocks=8,
                           max_model_len=32, max_num_batched_tokens=32, max_num_seqs=4,
                           prefix_caching=prefix_caching, async_scheduling=True, ignore_eos=True)
    assert runner.idle_preemptions == 1 and gen.scheduler.num_preemptions == 1 and runner.checked_steps > 3


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_long_run_in_a_tiny_pool_keeps_every_mirror_in_step(prefix_caching):
    """40 requests, half of them sharing a prefix, through a pool of 1.5 full sequences (12 blocks of
    4 tokens, max_model_len 32) in 16-token chunks, async: hundreds of steps, dozens of preemptions."""
    rng = random.Random(11)
    base = [rng.randrange(2, VOCAB) for _ in range(31)]
    prompts = [base[: rng.randint(1, 31)] if rng.random() < 0.5 else
               [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 31))] for _ in range(40)]
    runner, gen = run_loop(prompts, [rng.randint(1, 30) for _ in prompts], block_size=4, num_blocks=12,
                           max_model_len=32, max_num_batched_tokens=16, max_num_seqs=8,
                           prefix_caching=prefix_caching, async_scheduling=True, seed=3, ignore_eos=True)
    assert runner.checked_steps > 200 and gen.scheduler.num_preemptions > 40 and runner.idle_preemptions > 0


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(8, 40))
    per_seq = -(-max_model_len // block_size)
    num_blocks = per_seq + draw(st.integers(0, per_seq))  # one to two full sequences: heavy preemption
    bases = [draw(st.lists(st.integers(2, VOCAB - 1), min_size=max_model_len, max_size=max_model_len))
             for _ in range(2)]  # prompts share prefixes, so the prefix cache hits and frees shared blocks
    num = draw(st.integers(3, 16))
    prompts = [bases[draw(st.integers(0, 1))][: draw(st.integers(1, max_model_len - 1))] for _ in range(num)]
    max_tokens = [draw(st.integers(1, 40)) for _ in range(num)]
    return dict(prompts=prompts, max_tokens=max_tokens, block_size=block_size, num_blocks=num_blocks,
                max_model_len=max_model_len, max_num_batched_tokens=draw(st.integers(1, 24)),
                max_num_seqs=draw(st.integers(1, 6)), prefix_caching=draw(st.booleans()),
                async_scheduling=draw(st.sampled_from([True, True, False])), seed=draw(st.integers(0, 2**16)),
                ignore_eos=draw(st.booleans()))


# derandomize: CI must not fail on a run of luck; new cases are found by raising max_examples locally
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(workloads())
def test_every_mirror_equals_the_scheduler_tables_at_every_step(workload):
    run_loop(**workload)


def test_requests_are_pulled_only_as_the_batch_has_room():
    """A lazy source (a prompts file read a chunk at a time, or chunks handed to a replica) is asked for
    a request only when waiting + running is below max_num_seqs; every request still runs, in order."""
    pulled: list[int] = []
    pulled_at_finish: list[int] = []

    def feed(requests):
        for request in requests:
            pulled.append(request.index)
            yield request

    rng = random.Random(5)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 8))] for _ in range(30)]
    _, gen = run_loop(prompts, [rng.randint(1, 6) for _ in prompts], block_size=4, num_blocks=64, max_model_len=32,
                      max_num_batched_tokens=64, max_num_seqs=4, prefix_caching=True, async_scheduling=True,
                      ignore_eos=True, feed=feed, on_finish=lambda out: pulled_at_finish.append(len(pulled)))
    assert pulled == list(range(30)) and len(pulled_at_finish) == 30
    assert pulled_at_finish[0] <= 4, pulled_at_finish  # the old loop took all 30 before the first step
    assert all(n <= i + 4 for i, n in enumerate(pulled_at_finish)), pulled_at_finish  # never more than 4 ahead



@pytest.mark.parametrize("num_blocks", [200, 24])
def test_admission_stops_at_a_step_of_waiting_tokens_and_schedules_as_before(num_blocks, monkeypatch):
    """Requests are admitted only until the waiting queue holds a step's worth of tokens to compute
    (past cached prefixes): admitting more would change no schedule, and it put ~40 ms of host work
    before the bench's first launch. Every schedule equals the one of the admit-everything loop
    (every request counted as 0 tokens), with prefix hits and, in the small pool, preemptions."""
    from spmd_engine.core.scheduler import Scheduler

    rng = random.Random(2)
    base = [rng.randrange(2, VOCAB) for _ in range(24)]
    prompts = [base[: rng.randint(8, 24)] + [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 6))]
               if rng.random() < 0.5 else [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 30))]
               for _ in range(60)]
    max_tokens = [rng.randint(1, 12) for _ in prompts]

    def run():
        return run_loop(prompts, max_tokens, block_size=4, num_blocks=num_blocks, max_model_len=48,
                        max_num_batched_tokens=32, max_num_seqs=40, prefix_caching=True, async_scheduling=True,
                        ignore_eos=True)

    throttled, gen = run()
    with monkeypatch.context() as patch:
        patch.setattr(Scheduler, "tokens_to_compute", lambda self, seq: 0)
        everything, _ = run()
    assert throttled.schedules == everything.schedules and len(throttled.schedules) > 20
    assert everything.fed_at_schedule[0] == 40 and throttled.fed_at_schedule[0] < 10, throttled.fed_at_schedule
    assert gen.scheduler.block_manager.prefix_cache_hits > 0
    assert (gen.scheduler.num_preemptions > 0) == (num_blocks < 100)
