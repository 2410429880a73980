"""StepSampler: rank 0's sampling of one generate call's steps, from a launched forward's logits to
tokens on their way to the host, with the logprobs its requests asked for.

Why one place: every request option that acts on the draw (min_tokens, penalties, min_p, logprobs,
prompt logprobs) and the choice between a sampler-graph replay and the eager sampler are decided
per step from constants each request fixed at admission; the step loop hands a `LaunchedStep` in,
gets a `SampledStep` out, and collects it once its tokens are on the host.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from spmd_engine.core.plan import prompt_logit_count
from spmd_engine.core.scheduler import ScheduleOutput
from spmd_engine.core.sequence import Sequence
from spmd_engine.executor.logits_processors import apply_min_tokens, apply_penalties_and_min_p, stop_tokens_of
from spmd_engine.executor.logprobs import (PendingLogprobs, SampledLogprobRows, compute_logprobs, entry,
                                           host_to_device)
from spmd_engine.executor.sampler import Sampler, SamplingBatch, seed_bits
from spmd_engine.executor.sampler_graphs import SamplerGraphs
from spmd_engine.executor.token_readback import ReadbackBuffers, TokenReadback
from spmd_engine.structured.grammars import GrammarMasks, GrammarState
from spmd_engine.telemetry.gpu_timeline import GpuTimeline


class RowConsts(NamedTuple):
    """A request's sampling constants, gathered once at admission (a step reads them for every row)."""

    seed: int  # seed_bits of its noise seed
    temperature: float
    top_p: float
    top_k: int
    num_prompt_tokens: int
    transformed: bool  # logprobs, min_tokens, penalties or min_p: the logits processors look at it

    @classmethod
    def of(cls, seq: Sequence) -> "RowConsts":
        params = seq.params
        return cls(seed_bits(seq.sampling_seed), params.temperature, params.top_p, params.top_k,
                   seq.num_prompt_tokens,
                   bool(params.logprobs is not None or params.min_tokens or params.has_penalties or params.min_p > 0))


@dataclass
class PromptLogprobs:
    """A step's prompt logprobs: per sequence (seq, first position, count), rows in that order."""

    spans: list[tuple[Sequence, int, int]]
    pending: PendingLogprobs


@dataclass
class LaunchedStep:
    """A step whose forward is queued; its logits are valid until the next launch."""

    schedule: ScheduleOutput
    logits: torch.Tensor | None
    index: int  # step number within this generate call
    prompt_logprobs: PromptLogprobs | None = None  # queued on the device (requests with prompt_logprobs)
    # the decode graph whose static logits these are, for the sampler graphs (runner.sampler_graph_rows)
    graph_rows: int | None = None


@dataclass
class SampledStep:
    """A step whose tokens are sampled on the device and on their way to the host."""

    schedule: ScheduleOutput
    seqs: list[Sequence]  # the sampled rows, in order
    tokens: torch.Tensor | None  # [len(seqs)] on the device; None when the step sampled nothing
    readback: TokenReadback | None
    logprobs: tuple[list[int], PendingLogprobs] | None = None  # (rows of seqs, their logprobs) if any asked
    prompt_logprobs: PromptLogprobs | None = None

    def host_tokens(self) -> np.ndarray:
        """Waits for the GPU up to this step's sampling."""
        return self.readback.numpy() if self.readback is not None else np.zeros(0, dtype=np.int64)


class StepSampler:
    """Rank 0's sampling state for one generate call: each live request's row constants and logprobs."""

    def __init__(self, device: torch.device, eos_token_ids: Iterable[int], graphs: SamplerGraphs | None,
                 token_text: Callable[[int], str] | None) -> None:
        """`graphs`: the runner's sampler graphs (None: every step samples eagerly). `token_text(id)`: one
        token's text, for the logprobs' entries (None: no text)."""
        self.sampler = Sampler(device)
        self.readback_buffers = ReadbackBuffers()  # the sampled tokens' pinned host buffers, reused (CUDA)
        self.eos_token_ids = eos_token_ids
        self.graphs = graphs
        self.token_text = token_text
        self.row_consts: dict[int, RowConsts] = {}  # seq_id -> what its sampling rows need, fixed per request
        # released since the last collect: the step in flight may still sample them once (and drop the token)
        self.consts_done: list[int] = []
        # seq_id -> entries of requests with logprobs / prompt_logprobs (executor/logprobs.py)
        self.logprobs: dict[int, list[dict]] = {}
        self.prompt_logprobs: dict[int, list[dict | None]] = {}
        self.graph_steps = 0  # steps sampled by replaying a sampler graph
        self.grammars: dict[int, GrammarState] = {}  # seq_id -> its grammar (structured outputs)
        self.masks: GrammarMasks | None = None  # made at the first constrained row
        self.grammar_rebuilds = 0  # matchers rebuilt from their sequence's output (none expected)

    def admit(self, seq: Sequence, grammar: GrammarState | None = None) -> None:
        """Fix a new request's row constants and open its logprobs entries (if it asked for any); `grammar`:
        its structured output's matcher, whose mask every draw of the sequence takes."""
        params = seq.params
        if grammar is not None:
            self.grammars[seq.seq_id] = grammar
        if params.logprobs is not None:
            self.logprobs[seq.seq_id] = []
        if params.prompt_logprobs is not None:
            self.prompt_logprobs[seq.seq_id] = [None] * seq.num_prompt_tokens
        self.row_consts[seq.seq_id] = RowConsts.of(seq)

    def release(self, seq_id: int) -> tuple[list[dict] | None, list[dict | None] | None]:
        """A finished request's (logprobs, prompt_logprobs); its constants go at the next collect."""
        self.consts_done.append(seq_id)
        self.grammars.pop(seq_id, None)
        return self.logprobs.pop(seq_id, None), self.prompt_logprobs.pop(seq_id, None)

    def queue_prompt_logprobs(self, schedule: ScheduleOutput, logits: torch.Tensor | None) -> PromptLogprobs | None:
        """Prompt logprobs of a launched step's prompt rows (`logits`: the runner's last_prompt_logits;
        None when no request asked)."""
        if logits is None:
            return None
        spans: list[tuple[Sequence, int, int]] = []
        targets: list[int] = []
        for seq, start, num_new in zip(schedule.seqs, schedule.num_computed_before, schedule.num_new_tokens):
            count = prompt_logit_count(seq, start, num_new)
            if count:
                spans.append((seq, start, count))
                targets.extend(seq.token_ids[start + 1:start + 1 + count])  # position p predicts token p + 1
        k = max(seq.params.prompt_logprobs for seq, _, _ in spans)
        tokens = host_to_device(targets, logits.device)
        return PromptLogprobs(spans, compute_logprobs(logits, tokens, k))

    def sample(self, launched: LaunchedStep, timeline: GpuTimeline) -> SampledStep:
        """Queue sampling of a launched step's logits and the copy of its tokens to the host."""
        schedule = launched.schedule
        flags = schedule.sample
        seqs = [s for s, flag in zip(schedule.seqs, flags) if flag]
        if not seqs:
            return SampledStep(schedule, [], None, None, prompt_logprobs=launched.prompt_logprobs)
        # the counter is the index of the drawn token within the output (its position minus the
        # prompt), fixed at scheduling: planning ahead, chunking or preemption cannot shift a draw
        positions = [before + num_new for before, num_new, flag in
                     zip(schedule.num_computed_before, schedule.num_new_tokens, flags) if flag]
        consts = self.row_consts
        seeds, temperatures, top_ps, top_ks, prompt_lens, transformed = zip(*[consts[s.seq_id] for s in seqs])
        rows = SamplingBatch(np.array(seeds, dtype=np.int64),
                             np.array(positions, dtype=np.int64) - np.array(prompt_lens, dtype=np.int64),
                             np.array(temperatures, dtype=np.float64), np.array(top_ps, dtype=np.float64),
                             np.array(top_ks, dtype=np.int64))
        wanted = None
        if any(transformed):  # logprobs of the raw logits, before any transform (None and no work when no row asks)
            wanted = SampledLogprobRows.take(launched.logits, [s.params.logprobs for s in seqs])
        complete = ()  # rows whose grammar allows only their stop tokens: min_tokens leaves them alone
        if self.grammars:  # structured outputs: the grammar's mask first (min_p then sees the allowed tokens)
            complete = self._apply_grammars(launched.logits, seqs, rows.counters)
        if any(transformed):  # some row asks for logprobs, min_tokens, penalties or min_p
            picked = list(zip(seqs, positions))
            apply_min_tokens(launched.logits, picked, self.eos_token_ids, complete)
            apply_penalties_and_min_p(launched.logits, picked)
        timeline.mark(launched.index, "sample_start")
        tokens = self._draw(launched, rows, any(transformed))
        timeline.mark(launched.index, "sample_end")
        pending = (wanted.rows, wanted.finish(tokens)) if wanted is not None else None
        return SampledStep(schedule, seqs, tokens, TokenReadback(tokens, self.readback_buffers), pending,
                           launched.prompt_logprobs)

    def _apply_grammars(self, logits: torch.Tensor | None, seqs: list[Sequence], counters: np.ndarray) -> set[int]:
        """Mask the rows of constrained sequences (not finished) with their grammars' next-token bitmasks. A
        row's counter is the number of output tokens before its draw, all on the host and taken by the
        grammar by now (the previous step's tokens are post-processed first); a grammar that disagrees is
        rebuilt from the sequence's output. Returns the rows whose grammar allows nothing but their stop tokens."""
        rows, states = [], []
        for i, seq in enumerate(seqs):
            state = self.grammars.get(seq.seq_id)
            if state is None or seq.is_finished:
                continue
            if state.num_accepted != int(counters[i]):
                state.rebuild(seq.output_token_ids[:int(counters[i])])
                self.grammar_rebuilds += 1
            rows.append(i)
            states.append(state)
        if not rows:
            return set()
        if self.masks is None:
            self.masks = GrammarMasks(logits.shape[-1], logits.device)
        # only rows still short of min_tokens need to know (the check reads the row's whole bitmask on the host)
        stops = [stop_tokens_of(seqs[i], self.eos_token_ids) if int(counters[i]) < seqs[i].params.min_tokens
                 else None for i in rows]
        return set(self.masks.apply(logits, rows, states, stops))

    def _draw(self, launched: LaunchedStep, rows: SamplingBatch, transformed: bool) -> torch.Tensor:
        """One sampler-graph replay when the step allows it (all greedy / all plain), else the eager sampler."""
        tokens = None
        if launched.graph_rows is not None and not transformed:
            self.readback_buffers.fence()  # the replay overwrites the tokens an unread copy may still take
            tokens = self.graphs.sample(launched.graph_rows, rows)
            self.graph_steps += tokens is not None
        if tokens is None:
            tokens = self.sampler.sample_on_device(launched.logits, rows)
        return tokens

    def collect(self, sampled: SampledStep, tokens: np.ndarray) -> None:
        """A sampled step's tokens are on the host: record its logprobs, then forget the constants of the
        requests released before it (it was their last sampled step)."""
        if sampled.logprobs is not None or sampled.prompt_logprobs is not None:
            self._record_logprobs(sampled, tokens)
        for seq_id in self.consts_done:  # sampled for the last time: the step in flight came after their finish
            del self.row_consts[seq_id]
        self.consts_done.clear()

    def _record_logprobs(self, sampled: SampledStep, tokens: np.ndarray) -> None:
        """Read back a step's logprobs (only when some request asked: this waits for them); a token a
        finished sequence drops (a speculative step's) gets none."""
        if sampled.logprobs is not None:
            rows, pending = sampled.logprobs
            chosen, top_ids, top_lps = pending.host()
            for i, row in enumerate(rows):
                seq = sampled.seqs[row]
                entries = self.logprobs.get(seq.seq_id)
                if entries is not None and not seq.is_finished:
                    entries.append(entry(int(tokens[row]), chosen[i], top_ids[i], top_lps[i], seq.params.logprobs,
                                         self.token_text))
        if sampled.prompt_logprobs is not None:
            chosen, top_ids, top_lps = sampled.prompt_logprobs.pending.host()
            i = 0
            for seq, start, count in sampled.prompt_logprobs.spans:
                entries = self.prompt_logprobs.get(seq.seq_id)
                for p in range(start, start + count):
                    if entries is not None:
                        entries[p + 1] = entry(seq.token_ids[p + 1], chosen[i], top_ids[i], top_lps[i],
                                               seq.params.prompt_logprobs, self.token_text)
                    i += 1
