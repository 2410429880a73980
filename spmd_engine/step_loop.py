"""StepLoop: rank 0's loop for one generate call, the path every token takes.

One turn, in order: the sampled step's tokens come to the host -> `Scheduler.postprocess` (appends
them, finishes sequences, follows stop strings) -> requests admitted as the batch has room ->
`Scheduler.schedule` -> `PlanBuilder.build` -> the plan broadcast to the replica -> `ModelRunner.stage`
-> `StepSampler.sample` of the step in flight -> `ModelRunner.launch` (its logits feed the next turn's
sampling). Each stage gets its inputs as arguments; nothing is read from a shared context.

With async_scheduling (the default) the loop runs one step ahead of the GPU: while step N runs it
post-processes step N-1's tokens and plans, sends and stages step N+1; step N+1 takes the tokens
step N samples straight from the device, so the GPU never waits for the host's planning.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from spmd_engine.config import EngineConfig
from spmd_engine.core.detokenizer import OutputText, text_token_ids
from spmd_engine.core.plan import PlanBuilder, StepPlan
from spmd_engine.core.requests import (NOT_YET, PolledRequests, PromptRequest, RequestOutput, polled,
                                       validate_prompt)
from spmd_engine.core.scheduler import ScheduleOutput, Scheduler
from spmd_engine.core.sequence import SamplingParams, Sequence, SequenceStatus
from spmd_engine.distributed import Replica
from spmd_engine.executor.model_runner import ModelRunner, StagedStep
from spmd_engine.executor.sampler import request_seed
from spmd_engine.executor.step_sampler import LaunchedStep, SampledStep, StepSampler
from spmd_engine.faults.progress import StepProgress
from spmd_engine.structured.grammars import GrammarCompilerPool
from spmd_engine.telemetry.gpu_timeline import GpuTimeline
from spmd_engine.telemetry.step_timing import PhaseClock, StepTimer

log = logging.getLogger("spmd_engine.engine")


@dataclass(frozen=True)
class LoopParts:
    """What rank 0's loop drives, handed over by the engine for one generate call."""

    cfg: EngineConfig
    scheduler: Scheduler  # the engine's, for its life (its prefix cache outlives the call)
    runner: ModelRunner
    replica: Replica  # its broadcast_object sends the plans
    progress: StepProgress  # stamped per step; the watchdog reads it
    device: torch.device
    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class GenerateCall:
    """One generate call's requests and where their outputs go (Engine.generate's arguments)."""

    requests: PolledRequests
    total: int | None  # the number of requests when known (the progress bar's total)
    on_finish: Callable[[RequestOutput], None]
    decode: Callable[[list[int]], str] | None  # the tokenizer's decode (None: no text, no stop strings)
    token_text: Callable[[int], str] | None  # one token's text, for the logprobs' alternatives
    progress: bool = False
    keep_outputs: bool = True
    # structured outputs: the tokenizer's grammar compiler (None: no tokenizer, such requests are errors)
    grammars: GrammarCompilerPool | None = None

    @classmethod
    def of(cls, requests: Iterable[PromptRequest] | PolledRequests,
           on_finish: Callable[[RequestOutput], None] | None = None, decode: Callable[[list[int]], str] | None = None,
           token_text: Callable[[int], str] | None = None, progress: bool = False,
           keep_outputs: bool = True, grammars: GrammarCompilerPool | None = None) -> "GenerateCall":
        """Engine.generate's arguments, defaults filled in (`token_text` None: decode([id]))."""
        return cls(polled(requests), len(requests) if hasattr(requests, "__len__") else None,
                   on_finish or (lambda out: None), decode,
                   token_text or ((lambda t: decode([t])) if decode else None), progress, keep_outputs, grammars)


class StepLoop:
    """Rank 0's state for one generate call: the requests in flight, the steps in flight, the outputs."""

    def __init__(self, parts: LoopParts, call: GenerateCall, first_step: int) -> None:
        self.parts, self.call = parts, call
        self.scheduler = parts.scheduler
        self.preemptions_before = self.scheduler.num_preemptions
        self.prompt_computed_before = self.scheduler.num_prompt_tokens_computed
        self.builder = PlanBuilder()
        self.sampling = StepSampler(parts.device, self.scheduler.eos_token_ids, parts.runner.sampler_graphs,
                                    call.token_text)
        self.generation = first_step  # tells this generate call's unseeded request seeds from another's
        self.step = first_step  # the engine's step counter, handed back at the end with `summary`
        self.summary: dict[str, Any] = {}
        self.outputs: list[RequestOutput] = []
        self.live: dict[int, tuple[Sequence, RequestOutput]] = {}
        self.texts: dict[int, OutputText] = {}  # seq_id -> its followed text (requests with stop strings)
        self.fed = 0  # requests pulled so far
        self.next_seq_id = 0  # one sequence per completion (sampling.n of them per request)
        self.unfinished_children: dict[int, int] = {}  # first completion's seq_id -> the request's still running
        self.prompt_tokens = 0  # unique prompt tokens of the requests admitted (each n-sample family once)
        self.fed_all = False
        self.cached_tokens = 0
        # structured requests whose grammar is compiling (off the loop): (request, output, params, future)
        self.compiling: list[tuple[PromptRequest, RequestOutput, SamplingParams, Any]] = []

    # --- admission ---------------------------------------------------------------------------
    def _refill(self) -> None:
        """Pull requests until the batch could be full (waiting + running reach max_num_seqs) or the
        source ends: a lazy source is read, tokenized or handed out only as this replica has room.
        A polled source waits only while nothing runs; with sequences running, "not yet" ends the
        refill and the loop keeps stepping them (it asks again next step)."""
        if self.compiling:
            self._admit_compiled()
        scheduler, room = self.scheduler, self.parts.cfg.max_num_seqs
        # A step takes at most max_num_batched_tokens from the waiting queue, FCFS: admitting beyond that
        # changes no schedule and only puts host work before the first launch (256 bench requests: ~40 ms
        # of admission before step 0); later steps admit the rest while the GPU runs the one in flight.
        step_tokens, queued = self.parts.cfg.max_num_batched_tokens, None
        while not self.fed_all and scheduler.num_waiting + scheduler.num_running + len(self.compiling) < room:
            queued = scheduler.num_waiting_tokens if queued is None else queued
            if queued >= step_tokens:
                return
            request = self.call.requests.poll(wait=not scheduler.has_unfinished() and not self.compiling)
            if request is NOT_YET:
                return
            if request is None:
                self.fed_all = True
                return
            queued += self._admit(request)
            self.fed += 1

    def _admit(self, req: PromptRequest) -> int:
        """Queue `req` as its `n` completions (or finish it as an error row) -> the tokens it queued."""
        out = RequestOutput(req.index, req.prompt, req.prompt_token_ids, None, [], "error", req.error,
                            custom_id=getattr(req, "custom_id", None))
        params = self._checked_params(req, out)
        compiled = None
        if out.error is None and params.structured_outputs is not None:
            future = self.call.grammars.submit(params.structured_outputs)
            if not future.done():  # joins the batch once compiled (`_admit_compiled`); the batch runs on
                self.compiling.append((req, out, params, future))
                return 0
            compiled = self._compiled(future, out)
        return self._admit_checked(req, out, params, compiled)

    def _compiled(self, future: Any, out: RequestOutput) -> Any:
        """A done compilation's grammar, or None with `out.error` set (a schema, regex or grammar that does not
        compile)."""
        try:
            return future.result()
        except ValueError as exc:
            out.error = str(exc)
            return None

    def _admit_compiled(self, wait: bool = False) -> None:
        """Admit the structured requests whose grammar is compiled (`wait`: wait for the first one)."""
        if wait:
            concurrent.futures.wait([self.compiling[0][3]])
        still = []
        for req, out, params, future in self.compiling:
            if future.done():
                self._admit_checked(req, out, params, self._compiled(future, out))
            else:
                still.append((req, out, params, future))
        self.compiling = still

    def _admit_checked(self, req: PromptRequest, out: RequestOutput, params: SamplingParams | None,
                       compiled: Any) -> int:
        """Queue a checked request as its completions (or finish it as an error row) -> the tokens it queued."""
        if out.error is not None:
            out.text = None
            if self.call.keep_outputs:
                self.outputs.append(out)
            self.call.on_finish(out)
            self.bar.update(1)
            return 0
        seed = params.seed if params.seed is not None else request_seed(self.parts.cfg.seed, self.generation,
                                                                         req.index)
        self.prompt_tokens += len(req.prompt_token_ids)
        first, queued = None, 0
        indices = range(params.n) if req.completions is None else [i for i in req.completions if i < params.n]
        for i in indices:  # child i draws with seed + i (vLLM's rule): a seeded child is an n=1 request
            child = out if params.n == 1 else dataclasses.replace(out, sample_index=i, token_times=[])
            # completions after the first take the prompt's logprobs from it (they share its prompt blocks)
            child_params = params if i == 0 else dataclasses.replace(params, prompt_logprobs=None)
            seq = Sequence(self.next_seq_id, req.prompt_token_ids, child_params, sampling_seed=seed + i,
                           fork_from=first)
            self.next_seq_id += 1
            first = seq if first is None else first
            queued += self._queue(seq, child, compiled)
        if first is not None:
            self.unfinished_children[first.seq_id] = len(indices)
        return queued

    def _queue(self, seq: Sequence, out: RequestOutput, compiled: Any = None) -> int:
        """Hand one sequence (a completion) to the scheduler and the sampler -> the tokens it queued;
        `compiled`: its structured output's grammar (each completion gets a matcher of its own)."""
        if self.call.keep_outputs:
            self.outputs.append(out)
        text = None
        if seq.params.stop:
            text = self.texts[seq.seq_id] = OutputText(self.call.decode, seq.prompt_token_ids, seq.params.stop,
                                                       seq.params.include_stop_str_in_output)
        grammar = self.call.grammars.matcher(compiled) if compiled is not None else None
        self.sampling.admit(seq, grammar)
        self.scheduler.add(seq, stop_text=text, grammar=grammar)
        self.live[seq.seq_id] = (seq, out)
        return self.scheduler.tokens_to_compute(seq)

    def _checked_params(self, req: PromptRequest, out: RequestOutput) -> SamplingParams | None:
        """The request's sampling over the config's defaults; a request that cannot run sets `out.error`."""
        if out.error is not None:
            return None
        try:
            params = SamplingParams.from_dict(req.overrides, self.parts.cfg.sampling)
            out.error = validate_prompt(req.prompt_token_ids, self.parts.vocab_size, self.parts.max_model_len)
            if out.error is None and params.stop and self.call.decode is None:
                out.error = "sampling.stop needs the checkpoint's tokenizer (stop strings are matched on the " \
                            "text); use stop_token_ids"
            if out.error is None and params.structured_outputs is not None and self.call.grammars is None:
                out.error = "sampling.structured_outputs needs the checkpoint's tokenizer (grammars are built " \
                            "over its vocabulary)"
        except ValueError as exc:
            out.error = str(exc)
            return None
        return params

    # --- the loop ----------------------------------------------------------------------------
    def run(self) -> list[RequestOutput]:
        self.start = time.perf_counter()
        self.bar = _progress_bar(self.call.total, self.call.progress)
        loop = _InFlight(StepTimer(), GpuTimeline(self.parts.device.type == "cuda"))
        while self._step(loop):
            pass
        self._stop(loop)
        self.outputs.sort(key=lambda o: o.order)
        return self.outputs

    def _step(self, loop: _InFlight) -> bool:
        """One turn of the loop: collect the step sampled last, plan the next one and send it, stage its
        inputs, sample the step in flight (its tokens are the new plan's deferred inputs), launch.
        False once nothing is left to run."""
        clock, parts = loop.clock, self.parts
        clock.lap("postprocess")  # the previous turn's bookkeeping (counting it, the loop) since its last lap
        parts.progress.step(self.step)
        tokens = loop.sampled.host_tokens() if loop.sampled is not None else None  # waits for the GPU
        clock.lap("wait")
        if loop.sampled is not None:
            self._postprocess(loop.sampled, tokens)
            loop.sampled = None
        self._refill()
        clock.lap("postprocess")
        if loop.launched is None and not self.scheduler.has_unfinished():
            if not self.compiling:
                return False
            self._admit_compiled(wait=True)  # nothing else to run: wait for a grammar
            return True
        schedule = self.scheduler.schedule()
        # every schedule goes through the builder, even one that runs nothing: it may still have
        # preempted or finished sequences, whose drops the builder sends with the next plan
        plan = self.builder.build(schedule, self.step)
        if plan is None:  # every running sequence waits for the step in flight
            if loop.launched is None:
                raise RuntimeError("scheduler made no progress (no sequence fits the KV pool)")
            self._sample_in_flight(loop)
            return True
        clock.lap("schedule")
        parts.replica.broadcast_object(plan)
        clock.lap("broadcast")
        staged = parts.runner.stage(plan)
        clock.lap("inputs")
        self._sample_in_flight(loop)
        clock.lap("sample")
        self._launch(loop, schedule, staged)
        clock.lap("forward")
        if not parts.cfg.async_scheduling:
            self._sample_in_flight(loop)
        clock.lap("sample")
        loop.count(plan, staged.launch_kind)
        self.step += 1
        return True

    def _launch(self, loop: _InFlight, schedule: ScheduleOutput, staged: StagedStep) -> None:
        """Launch a staged step's forward; its inputs deferred to the step in flight take that step's tokens."""
        runner = self.parts.runner
        loop.timeline.mark(loop.steps, "forward_start")
        logits = runner.launch(staged, loop.sampled.tokens if loop.sampled is not None else None)
        loop.timeline.mark(loop.steps, "forward_end")
        self.parts.progress.forward_issued()
        prompt_logprobs = self.sampling.queue_prompt_logprobs(schedule, runner.last_prompt_logits)
        loop.launched = LaunchedStep(schedule, logits, loop.steps, prompt_logprobs, runner.sampler_graph_rows(staged))

    def _sample_in_flight(self, loop: _InFlight) -> None:
        """Queue sampling of the launched step, if any: it becomes the sampled step."""
        if loop.launched is not None:
            loop.sampled, loop.launched = self.sampling.sample(loop.launched, loop.timeline), None

    def _stop(self, loop: _InFlight) -> None:
        """Send every rank the stop plan, then summarise the call's steps into `summary`."""
        parts = self.parts
        stop = self.builder.stop_plan(self.step)
        parts.replica.broadcast_object(stop)
        parts.runner.apply_stop(stop)
        parts.progress.idle()
        self.bar.close()
        loop.timer.set_gpu_idle(loop.timeline.idle_ms(), loop.timeline.busy_ms())
        cached = self.cached_tokens
        preemptions = self.scheduler.num_preemptions - self.preemptions_before
        computed = self.scheduler.num_prompt_tokens_computed - self.prompt_computed_before
        self.summary = {"steps": loop.steps, "decode_steps": loop.decode_steps,
                        "async_scheduling": parts.cfg.async_scheduling, "preemptions": preemptions,
                        "cached_prompt_tokens": cached, "sampler_graph_steps": self.sampling.graph_steps,
                        "unique_prompt_tokens": self.prompt_tokens,  # an n-sample request's prompt once
                        "prompt_tokens_computed": computed,
                        "step_timing": loop.timer.summary()}
        log.info("generate: %d steps (%d decode), %d preemptions, %d prompt tokens from the prefix cache",
                 loop.steps, loop.decode_steps, preemptions, cached)

    # --- outputs -----------------------------------------------------------------------------
    def _postprocess(self, sampled: SampledStep, tokens: np.ndarray) -> None:
        self.sampling.collect(sampled, tokens)
        now = time.perf_counter() - self.start
        by_seq: dict[int, int] = {}
        live, finished = self.live, SequenceStatus.FINISHED
        for seq, token in zip(sampled.seqs, tokens.tolist()):  # Python ints at once, not one int() per row
            if seq.status is finished:
                continue
            out = live[seq.seq_id][1]
            if out.first_token_time is None:
                out.first_token_time = now
            out.token_times.append(now)
            by_seq[seq.seq_id] = token
        for seq in self.scheduler.postprocess(sampled.schedule, by_seq):
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        _, out = self.live.pop(seq.seq_id)
        out.token_ids = list(seq.output_token_ids)
        out.finish_reason = seq.finish_reason
        out.stop_reason = seq.stop_reason
        out.logprobs, out.prompt_logprobs = self.sampling.release(seq.seq_id)
        out.num_cached_tokens = seq.num_cached_tokens
        self.cached_tokens += seq.num_cached_tokens
        followed = self.texts.pop(seq.seq_id, None)
        if followed is not None and followed.match is not None:
            out.text = followed.match.text  # cut at the stop string (or just after it)
        else:
            ids = text_token_ids(out.token_ids, seq.finish_reason, seq.stop_reason,
                                 seq.params.include_stop_str_in_output)
            out.text = self.call.decode(ids) if self.call.decode else None
        self.call.on_finish(out)
        family = (seq.fork_from or seq).seq_id
        left = self.unfinished_children[family] = self.unfinished_children[family] - 1
        if not left:  # the progress bar counts requests: its last completion is in
            del self.unfinished_children[family]
            self.bar.update(1)


@dataclass
class _InFlight:
    """The loop's steps between launch and collection, and its step counts (one generate call)."""

    timer: StepTimer
    timeline: GpuTimeline
    launched: LaunchedStep | None = None  # forward queued, logits not sampled yet
    sampled: SampledStep | None = None  # tokens sampled on the device, not yet on the host
    steps: int = 0
    decode_steps: int = 0
    clock: PhaseClock = field(default_factory=PhaseClock)  # runs for the whole loop (PhaseClock.take)

    def count(self, plan: StepPlan, launch_kind: str) -> None:
        """Count a launched step and record its host phases and how it ran (decode graph, piecewise, eager)."""
        self.timer.add(plan.num_seqs, plan.num_tokens, plan.is_decode,
                       num_decode_seqs=int((plan.query_lens == 1).sum()), launch=launch_kind, **self.clock.take())
        self.steps += 1
        self.decode_steps += int(plan.is_decode)


def _progress_bar(total: int | None, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc="requests", unit="req", disable=not enabled or (total or 0) < 2,
                dynamic_ncols=True)
