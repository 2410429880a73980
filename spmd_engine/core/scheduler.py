"""Rank-0 scheduler: picks each step's token batch under token/sequence/KV-block budgets.

vLLM-v1 style unified steps: one step mixes decodes and (chunked) prefills; running sequences
go first, then waiting ones are admitted FCFS; when KV blocks run out the most recently
admitted running sequence is preempted and later recomputed from scratch.

A step is accounted when it is scheduled (num_computed_tokens advances, a sampled token becomes
pending), so the next step can be planned before this one's tokens are read back (async
scheduling); `postprocess` then appends the tokens and finishes sequences. A sequence sampled in
the last step runs one more token whose input the forward takes from that step's sampled tokens.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from spmd_engine.core.block_manager import BlockManager
from spmd_engine.core.detokenizer import OutputText
from spmd_engine.core.sequence import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Sequence,
    SequenceStatus,
)

logger = logging.getLogger(__name__)


class TokenGrammar(Protocol):
    """A structured-output request's grammar (spmd_engine/structured/grammars.GrammarState)."""

    def accept(self, token: int) -> bool:
        """Take the next output token; True once the grammar has ended."""


@dataclass
class SchedulerConfig:
    """Budgets and KV-pool shape; the fields are top-level config keys (num_blocks: the KV pool size)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    # prompt tokens (prefill chunks, admissions) in a step that also decodes; None: only the token budget
    max_prompt_tokens_per_mixed_step: int | None = None

    def validate(self) -> "SchedulerConfig":
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        cap = self.max_prompt_tokens_per_mixed_step
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"max_prompt_tokens_per_mixed_step must be an integer >= 1 or None, got {cap!r}")
        per_seq = -(-self.max_model_len // self.block_size)
        if self.num_blocks < per_seq:
            raise ValueError(
                f"the KV pool must hold ceil(max_model_len / block_size) = {per_seq} blocks so one "
                f"full-length sequence fits, got num_blocks={self.num_blocks}"
            )
        return self

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


@dataclass
class ScheduleOutput:
    """One step's decision; lists of the scheduled sequences are aligned (batch order)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens computed this step
    num_computed_before: list[int] = field(default_factory=list)  # tokens already in KV
    sample: list[bool] = field(default_factory=list)  # the chunk reaches the last token: sample
    preempted: list[Sequence] = field(default_factory=list)  # lost their blocks this step
    finished_seq_ids: list[int] = field(default_factory=list)  # finished/aborted since last schedule
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, new) before the forward

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def _add(self, seq: Sequence, num_new: int) -> None:
        """Schedule `num_new` tokens of `seq` and account for them now (see the module docstring)."""
        before = seq.num_computed_tokens
        sample = before + num_new == len(seq.token_ids) + seq.num_pending_tokens  # reaches num_planned_tokens
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new)
        self.num_computed_before.append(before)
        self.sample.append(sample)
        seq.num_computed_tokens = before + num_new
        seq.num_pending_tokens += sample


def _uses_prefix_cache(seq: Sequence) -> bool:
    """A request with prompt logprobs computes every position: no prefix-cache hit for it."""
    return seq.params.prompt_logprobs is None


def _shareable_prompt_tokens(seq: Sequence) -> int:
    """The prompt tokens whose KV a later completion may take from its first completion, short of its last
    token (one token must be computed for its logits)."""
    return min(seq.num_prompt_tokens, seq.num_tokens - 1)


class Scheduler:
    """Owns the waiting queue, the running list and the block manager (rank 0 only)."""

    def __init__(self, config: SchedulerConfig, eos_token_ids: set[int],
                 block_manager: BlockManager | None = None) -> None:
        """`block_manager`: an idle one (no block in use) kept from an earlier run, so its prefix cache
        still hits; None = a fresh pool."""
        self.config = config.validate()
        self.eos_token_ids = set(eos_token_ids)
        if block_manager is None:
            block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        elif block_manager.num_used_blocks or (block_manager.num_blocks, block_manager.block_size,
                                               block_manager.enable_prefix_caching) != (
                config.num_blocks, config.block_size, config.enable_prefix_caching):
            raise ValueError("a reused block manager must be idle and match num_blocks, block_size and "
                             "enable_prefix_caching")
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self._unfinished: dict[int, Sequence] = {}
        self._left_since_schedule: list[int] = []
        self._stop_texts: dict[int, OutputText] = {}  # seq_id -> its followed text (requests with stop strings)
        self._grammars: dict[int, TokenGrammar] = {}  # seq_id -> its grammar (structured outputs)
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # prompt positions scheduled for compute (recomputes included)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting sequences would compute if admitted now."""
        return sum(self.tokens_to_compute(seq) for seq in self.waiting)

    def tokens_to_compute(self, seq: Sequence) -> int:
        """Tokens admitting `seq` now would leave to compute: past its cached prefix, as `_admit_waiting`
        would find it (a later completion of an n-sample request: past the prompt blocks it will share)."""
        bm = self.block_manager
        if seq.fork_from is not None and not seq.fork_from.is_finished:
            return seq.num_tokens - _shareable_prompt_tokens(seq)
        return bm.num_tokens_to_compute(seq, use_cache=_uses_prefix_cache(seq))

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def add(self, seq: Sequence, stop_text: OutputText | None = None, grammar: TokenGrammar | None = None) -> None:
        """Queue `seq`; `stop_text` follows its output text for its stop strings (fed every token); `grammar`
        (structured outputs) takes every token too and ends the sequence ("stop") when it has ended."""
        if seq.seq_id in self._unfinished:
            raise ValueError(f"request id {seq.seq_id} is already in flight")
        if seq.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {seq.seq_id}: prompt has {seq.num_tokens} tokens, more than "
                f"max_model_len={self.config.max_model_len}"
            )
        seq.params.validate()
        seq.status = SequenceStatus.WAITING
        self._unfinished[seq.seq_id] = seq
        if stop_text is not None:
            self._stop_texts[seq.seq_id] = stop_text
        if grammar is not None:
            self._grammars[seq.seq_id] = grammar
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> bool:
        """Stop a request wherever it is (finish_reason "abort"); False if it is not in flight."""
        seq = self._unfinished.get(seq_id)
        if seq is None:
            return False
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._finish(seq, FINISH_ABORT)
        return True

    def schedule(self) -> ScheduleOutput:
        out = ScheduleOutput(finished_seq_ids=self._left_since_schedule)
        self._left_since_schedule = []
        budgets = self._schedule_running(out, self.config.max_num_batched_tokens, self._prompt_budget())
        num_admitted = self._admit_waiting(out, *budgets)
        if logger.isEnabledFor(logging.DEBUG):
            self._log_schedule(out, num_admitted)
        return out

    def _schedule_running(self, out: ScheduleOutput, token_budget: int, prompt_budget: int) -> tuple[int, int]:
        """Running sequences, in admission order: decodes take 1 token, prefills their next chunk (within
        `prompt_budget` prompt tokens); when blocks run out the most recently admitted is preempted.
        Returns the token and prompt budgets left."""
        block_size, max_model_len = self.block_manager.block_size, self.config.max_model_len
        running = self.running
        seqs, new_tokens, computed_before, samples = out.seqs, out.num_new_tokens, out.num_computed_before, out.sample
        i = 0
        while i < len(running) and token_budget > 0:
            seq = running[i]
            token_ids, pending, computed = seq.token_ids, seq.num_pending_tokens, seq.num_computed_tokens
            remaining = len(token_ids) + pending - computed  # planned - computed
            if pending:  # `_ends_with_pending`, inline (asked per running sequence per step)
                planned = len(token_ids) + pending
                if planned - seq.num_prompt_tokens >= seq.params.max_tokens or planned >= max_model_len:
                    i += 1  # finishes by length once its pending token is read
                    continue
            if remaining > 1 and prompt_budget <= 0:
                i += 1  # no prompt budget left
                continue
            num_new = min(remaining, token_budget) if remaining == 1 else min(remaining, token_budget, prompt_budget)
            total = computed + num_new
            # the table covers the tokens (most steps): no call; else grow it, preempting if short
            if total > len(seq.block_table) * block_size and not self._make_room(seq, total, out):
                continue  # `seq` itself was preempted (the last running one): the loop ends
            # ScheduleOutput._add, inline: account for the tokens now (see the module docstring)
            sample = total == len(token_ids) + pending  # reaches num_planned_tokens
            seqs.append(seq)
            new_tokens.append(num_new)
            computed_before.append(computed)
            samples.append(sample)
            seq.num_computed_tokens = total
            seq.num_pending_tokens = pending + sample
            if computed < seq.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(total, seq.num_prompt_tokens) - computed
            token_budget -= num_new
            prompt_budget -= num_new if remaining > 1 else 0
            i += 1
        return token_budget, prompt_budget

    def _make_room(self, seq: Sequence, num_tokens_total: int, out: ScheduleOutput) -> bool:
        """Grow `seq`'s table to `num_tokens_total` tokens, preempting the most recently admitted
        running sequences while the pool is short; False if `seq` itself was preempted."""
        while not self.block_manager.ensure_slots(seq, num_tokens_total):
            victim = self.running.pop()  # most recently admitted; never one already scheduled
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit_waiting(self, out: ScheduleOutput, token_budget: int, prompt_budget: int) -> int:
        """Admit waiting sequences FCFS (not after a preemption: the pool is tight right now); returns
        how many were admitted."""
        bm = self.block_manager
        num_admitted = 0
        while (
            self.waiting
            and not out.preempted
            and min(token_budget, prompt_budget) > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            if seq.num_pending_tokens:  # preempted while its token was pending: wait for it
                break
            shared, copy = self._shared_prompt_tokens(seq, out), None
            if shared is None:  # its first completion is still prefilling the prompt: wait for it (FCFS)
                break
            if shared:
                copy = bm.fork_prefix(seq, seq.fork_from, shared)
            else:
                bm.allocate_prefix(seq, use_cache=_uses_prefix_cache(seq))
            num_new = min(seq.num_tokens - seq.num_computed_tokens, token_budget, prompt_budget)
            if not bm.ensure_slots(seq, seq.num_computed_tokens + num_new):
                bm.undo_prefix(seq)
                break
            if copy is not None:
                out.block_copies.append(copy)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.num_prompt_tokens_computed += max(0, min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens)
                                                   - seq.num_computed_tokens)
            out._add(seq, num_new)
            token_budget -= num_new
            prompt_budget -= num_new
            num_admitted += 1
        return num_admitted

    def _shared_prompt_tokens(self, seq: Sequence, out: ScheduleOutput) -> int | None:
        """How many prompt tokens' KV `seq` (a completion i > 0 of an n-sample request) takes from its first
        completion at admission (full blocks shared, the partial last one copied); 0: none, admit as usual;
        None: wait, that completion is computing them.

        Taken: the prompt short of `seq`'s last token (one token must be computed for its logits), once
        steps before this one computed it (a step runs after every step queued before it, on every rank,
        so their KV is written when it reads it, or copies it). Only while the first completion runs: a
        preempted or finished one shares nothing (the prefix cache may still hit), so a completion never
        waits on one that waits."""
        source = seq.fork_from
        if source is None or source.status is not SequenceStatus.RUNNING:
            return 0
        num_tokens = _shareable_prompt_tokens(seq)
        if num_tokens <= 0:
            return 0
        computed = source.num_computed_tokens
        for scheduled, before in zip(out.seqs, out.num_computed_before):
            if scheduled is source:  # what it had computed before this step
                computed = before
                break
        return num_tokens if computed >= num_tokens else None

    def _log_schedule(self, out: ScheduleOutput, num_admitted: int) -> None:
        num_decode = sum(1 for n, c in zip(out.num_new_tokens, out.num_computed_before) if n == 1 and c > 0)
        logger.debug(
            "schedule: %d seqs (%d decode, %d prefill, %d admitted), %d tokens, %d preempted, "
            "waiting=%d running=%d free_blocks=%d",
            out.num_seqs, num_decode, out.num_seqs - num_decode, num_admitted, out.num_tokens,
            len(out.preempted), len(self.waiting), len(self.running), self.block_manager.num_free_blocks,
        )

    def postprocess(self, output: ScheduleOutput, sampled: dict[int, int]) -> list[Sequence]:
        """Take a step's sampled tokens (seq_id -> token) once they are on the host: cache the blocks
        the step completed, append the tokens, finish sequences; return the newly finished."""
        finished: list[Sequence] = []
        bm = self.block_manager
        caching, chains, block_size = bm.enable_prefix_caching, bm.hash_chains, bm.block_size
        running, done = SequenceStatus.RUNNING, SequenceStatus.FINISHED
        for seq, before, num_new, sample in zip(output.seqs, output.num_computed_before, output.num_new_tokens,
                                                output.sample):
            status = seq.status
            if status is done:  # aborted, or finished by the step before (this one ran speculatively)
                continue
            if status is running and caching:  # a preempted one holds no blocks any more
                chain = chains.get(seq.seq_id)  # skip the call when no block can have completed (most steps)
                if (before + num_new) // block_size > (chain[0] if chain is not None else 0):
                    bm.cache_full_blocks(seq, before + num_new)
            if not sample:
                continue
            token = sampled[seq.seq_id]
            seq.num_pending_tokens -= 1
            seq.token_ids.append(int(token))  # Sequence.append_token, inline: once per sequence per step
            reason = self._stop_reason(seq, token)
            if reason is not None:
                if seq.status is SequenceStatus.WAITING:
                    self.waiting.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        if finished:
            self.running = [s for s in self.running if not s.is_finished]
        return finished

    def _prompt_budget(self) -> int:
        """Prompt tokens this step may take: the cap when a running sequence decodes (one token left to
        compute), else the whole token budget (start-up, or every running sequence prefilling)."""
        cap = self.config.max_prompt_tokens_per_mixed_step
        if cap is None or not any(s.num_planned_tokens - s.num_computed_tokens == 1 for s in self.running):
            return self.config.max_num_batched_tokens
        return cap

    def _ends_with_pending(self, seq: Sequence) -> bool:
        """A pending token that will be the sequence's last (max_tokens or max_model_len)."""
        pending = seq.num_pending_tokens
        if not pending:
            return False
        planned = len(seq.token_ids) + pending  # num_planned_tokens (asked per running sequence per step)
        return planned - seq.num_prompt_tokens >= seq.params.max_tokens or planned >= self.config.max_model_len

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        """EOS, a stop token, a stop string (none before min_tokens), then the length limits. A sequence
        finished here that has a speculative step in flight drops its token, whatever stopped it."""
        params = seq.params
        num_tokens = len(seq.token_ids)  # called for every sampled token: the properties, inline
        num_output = num_tokens - seq.num_prompt_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return FINISH_STOP
            if params.stop_token_ids and token in params.stop_token_ids:
                seq.stop_reason = token
                return FINISH_STOP
        if params.stop:
            text = self._stop_texts.get(seq.seq_id)
            matched = text.add(token, num_output >= params.min_tokens) if text is not None else None
            if matched is not None:  # fed every token: it follows the text
                seq.stop_reason = matched.stop
                return FINISH_STOP
        if params.structured_outputs is not None:
            grammar = self._grammars.get(seq.seq_id)
            if grammar is not None and grammar.accept(token):  # its stop token taken: the output is complete
                return FINISH_STOP
        if num_output >= params.max_tokens or num_tokens >= self.config.max_model_len:
            return FINISH_LENGTH
        return None

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop its KV, keep its tokens (a pending one is appended when it
        arrives, before the sequence can be readmitted), requeue it first."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._unfinished[seq.seq_id]
        self._stop_texts.pop(seq.seq_id, None)
        self._grammars.pop(seq.seq_id, None)
        self._left_since_schedule.append(seq.seq_id)
