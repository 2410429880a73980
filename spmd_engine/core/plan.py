"""StepPlan: the whole per-step contract between rank 0 (scheduler) and every rank (forward).

Rank 0 builds one plan per step and broadcasts it with `broadcast_object_list`; every rank,
rank 0 included, turns the same plan into the same forward inputs. To stay small at large
batches the plan carries block-table *deltas*: every rank keeps a `BlockTableMirror` that the
plans update, so a decode step ships a few bytes per sequence instead of whole tables.

With async scheduling a plan is built before the previous step's sampled tokens reach the host:
those inputs are *deferred*, and every rank fills them on the device from the previous step's
tokens (which rank 0 broadcasts as a tensor) right before the forward.

Invariant: every scheduler decision that changes a block table (admission, growth, preemption,
finish) reaches every mirror before any forward that could read that table. A schedule with
nothing to run (async: every running sequence waits for the step in flight) can still preempt or
finish sequences; `PlanBuilder.build` returns no plan for it and sends those drops with the next
plan (or the stop plan). Both ends check the invariant on every step: the builder that the table
the mirrors hold is still the scheduler's (else a drop was lost), each mirror that its tables cover
every KV slot the step touches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress
from typing import TYPE_CHECKING, NamedTuple

import numpy as np


if TYPE_CHECKING:
    from spmd_engine.core.scheduler import ScheduleOutput
    from spmd_engine.core.sequence import Sequence

COMMAND_FORWARD = "forward"
COMMAND_STOP = "stop"


def _empty(dtype) -> np.ndarray:
    return np.zeros(0, dtype=dtype)



def prompt_logit_count(seq: Sequence, start: int, num_new: int) -> int:
    """How many positions of the chunk [start, start + num_new) predict a prompt token (positions
    0 .. num_prompt_tokens - 2), for a request with prompt_logprobs; 0 otherwise."""
    if seq.params.prompt_logprobs is None:
        return 0
    return max(0, min(start + num_new, seq.num_prompt_tokens - 1) - start)

@dataclass
class StepPlan:
    """One engine step. Arrays of length B are aligned with `seq_ids` (the batch order)."""

    step: int
    command: str = COMMAND_FORWARD  # "forward" | "stop"
    seq_ids: np.ndarray = field(default_factory=lambda: _empty(np.int64))  # [B]
    num_computed: np.ndarray = field(default_factory=lambda: _empty(np.int32))  # [B] tokens already in KV
    query_lens: np.ndarray = field(default_factory=lambda: _empty(np.int32))  # [B] tokens computed now
    input_ids: np.ndarray = field(default_factory=lambda: _empty(np.int32))  # [sum(query_lens)]
    sample: np.ndarray = field(default_factory=lambda: _empty(np.bool_))  # [B] sample a token after this step
    # block-table deltas, applied to every rank's BlockTableMirror before the forward
    reset_tables: np.ndarray = field(default_factory=lambda: _empty(np.bool_))  # [B] forget the old table first
    new_block_counts: np.ndarray = field(default_factory=lambda: _empty(np.int32))  # [B] blocks appended
    new_block_ids: np.ndarray = field(default_factory=lambda: _empty(np.int32))  # [sum(new_block_counts)]
    dropped_seq_ids: np.ndarray = field(default_factory=lambda: _empty(np.int64))  # tables to forget
    # KV blocks to copy before the forward, (source, destination) rows: a later completion of an n-sample
    # request takes its first completion's partial last prompt block (full blocks are shared)
    block_copies: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int32))  # [C, 2]
    # inputs sampled by the previous step, not yet known on the host: input_ids[deferred_positions[i]]
    # is that step's sampled token number deferred_rows[i] (of num_prev_sampled); input_ids holds 0 there
    deferred_positions: np.ndarray = field(default_factory=lambda: _empty(np.int32))  # [D]
    deferred_rows: np.ndarray = field(default_factory=lambda: _empty(np.int32))  # [D]
    num_prev_sampled: int = 0
    # prompt logprobs: the first prompt_logits[b] tokens of sequence b also get logits (rank 0 turns them
    # into logprobs, spmd_engine/logprobs.py); empty when no request of the step asked for them
    prompt_logits: np.ndarray = field(default_factory=lambda: _empty(np.int32))  # [B] or [0]

    @property
    def has_prompt_logits(self) -> bool:
        return bool(self.prompt_logits.shape[0]) and bool(self.prompt_logits.any())

    @property
    def num_seqs(self) -> int:
        return int(self.seq_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.num_seqs > 0 and bool(np.all(self.query_lens == 1))


class _SentTable(NamedTuple):
    """What rank 0 knows of one sequence's table on the mirrors: enough to tell in O(1) that it is
    still a prefix of the scheduler's table (a tuple: checked for every sequence of every step)."""

    num_blocks: int
    last_block: int  # its last block id (-1: empty)
    num_preemptions: int  # the sequence's preemption count when the table was sent


def _stale_table(held: _SentTable, seq: Sequence, step: int) -> RuntimeError:
    table, n = seq.block_table, held.num_blocks
    return RuntimeError(
        f"step {step}: seq {seq.seq_id}: the ranks' block table ({n} blocks, last {held.last_block}) is "
        f"stale: the scheduler's now has {len(table)} blocks"
        f"{f', block {n - 1} = {table[n - 1]}' if 0 < n <= len(table) else ''}, and the sequence was "
        f"preempted {seq.num_preemptions - held.num_preemptions} time(s) since; a preemption or free "
        f"never reached the plans, so attention would read the wrong KV blocks")


class PlanBuilder:
    """Rank 0: turns a ScheduleOutput into a StepPlan, sending each block table only as deltas.

    It remembers what each sequence's table on the mirrors is; a sequence it holds no record of
    (new, or readmitted after preemption) is sent with `reset_tables` and its whole table.
    """

    def __init__(self) -> None:
        self._sent: dict[int, _SentTable] = {}  # seq_id -> the table the mirrors hold
        self._unsent_drops: list[int] = []  # dropped by schedules that ran nothing: go with the next plan
        self._sample_rows: dict[int, int] = {}  # seq_id -> its row in the last plan's sampled tokens
        self._num_sampled = 0

    @property
    def num_tracked(self) -> int:
        return len(self._sent)

    @property
    def num_unsent_drops(self) -> int:
        return len(self._unsent_drops)

    def stop_plan(self, step: int) -> StepPlan:
        """The plan that ends every rank's step loop; it drops every table still held (a mirror
        that applies it is left empty for the next run)."""
        dropped = np.asarray(self._unsent_drops + list(self._sent), dtype=np.int64)
        self._sent.clear()
        self._unsent_drops = []
        self._sample_rows, self._num_sampled = {}, 0
        return StepPlan(step=step, command=COMMAND_STOP, dropped_seq_ids=dropped)

    def build(self, output: ScheduleOutput, step: int) -> StepPlan | None:
        """The plan for `output`; None when it runs nothing. Call it for *every* schedule: one that
        runs nothing can still have preempted or finished sequences, and their drops are kept and
        sent with the next plan (so a readmitted sequence is sent whole, never as a delta on a
        table the scheduler freed)."""
        left = [s.seq_id for s in output.preempted] + list(output.finished_seq_ids)
        dropped = self._unsent_drops + [sid for sid in left if self._sent.pop(sid, None) is not None]
        if output.is_empty:
            self._unsent_drops = dropped
            return None
        self._unsent_drops = []

        resets: list[bool] = []  # Python lists, one array each at the end: numpy item writes cost more
        counts: list[int] = []
        new_ids: list[int] = []
        inputs = _Inputs()
        ids, deferred_positions, deferred_rows = inputs.ids, inputs.deferred_positions, inputs.deferred_rows
        sent_tables, sample_rows = self._sent, self._sample_rows
        seq_ids: list[int] = []
        for seq, start, n in zip(output.seqs, output.num_computed_before, output.num_new_tokens):
            # the common cases inline (per sequence per step): a held table that gained no block, then
            # a decode input that is known (one append) or the token the step in flight is sampling
            seq_id, table = seq.seq_id, seq.block_table
            seq_ids.append(seq_id)
            held = sent_tables.get(seq_id)
            if held is not None and held[0] == len(table) and held[2] == seq.num_preemptions and (
                    not held[0] or table[held[0] - 1] == held[1]):
                resets.append(False)
                counts.append(0)
            else:
                reset, count = self._table_delta(seq, step, new_ids)
                resets.append(reset)
                counts.append(count)
            if n == 1:
                num_known = len(seq.token_ids) - start
                if num_known > 0:
                    ids.append(seq.token_ids[start])
                    continue
                row = sample_rows.get(seq_id)
                if num_known == 0 and row is not None:
                    deferred_positions.append(len(ids))
                    deferred_rows.append(row)
                    ids.append(0)
                    continue
            self._add_inputs(seq, start, n, inputs)  # prompt chunks, and the errors
        prev_sampled = self._num_sampled
        sampled_ids = list(compress(seq_ids, output.sample))
        self._sample_rows = dict(zip(sampled_ids, range(len(sampled_ids))))
        self._num_sampled = len(sampled_ids)

        return StepPlan(
            step=step,
            seq_ids=np.array(seq_ids, dtype=np.int64),
            num_computed=np.asarray(output.num_computed_before, dtype=np.int32),
            query_lens=np.asarray(output.num_new_tokens, dtype=np.int32),
            input_ids=np.asarray(inputs.ids, dtype=np.int32),
            sample=np.asarray(output.sample, dtype=np.bool_),
            reset_tables=np.asarray(resets, dtype=np.bool_),
            new_block_counts=np.asarray(counts, dtype=np.int32),
            new_block_ids=np.asarray(new_ids, dtype=np.int32),
            dropped_seq_ids=np.asarray(dropped, dtype=np.int64),
            block_copies=np.asarray(output.block_copies, dtype=np.int32).reshape(-1, 2),
            deferred_positions=np.asarray(inputs.deferred_positions, dtype=np.int32),
            deferred_rows=np.asarray(inputs.deferred_rows, dtype=np.int32),
            num_prev_sampled=prev_sampled if inputs.deferred_positions else 0,
            prompt_logits=_prompt_logits(output),
        )

    def _table_delta(self, seq: Sequence, step: int, new_ids: list[int]) -> tuple[bool, int]:
        """Append to `new_ids` the blocks of `seq`'s table the mirrors lack; returns (reset the mirrors'
        table first, number of blocks appended). Raises if the mirrors' table is no longer a prefix of
        the scheduler's (a lost drop). Called per sequence per step: the common case (a held table
        that gained no block) returns after the check, with no other lookup."""
        table = seq.block_table
        num_blocks = len(table)
        held = self._sent.get(seq.seq_id)
        if held is None:
            self._sent[seq.seq_id] = _SentTable(num_blocks, table[-1] if table else -1, seq.num_preemptions)
            new_ids.extend(table)
            return True, num_blocks
        sent, last, preemptions = held  # the consistency check: the mirrors' table must still be a prefix
        if preemptions != seq.num_preemptions or num_blocks < sent or (sent and table[sent - 1] != last):
            raise _stale_table(held, seq, step)
        if num_blocks == sent:
            return False, 0
        new_ids.extend(table[sent:])
        self._sent[seq.seq_id] = _SentTable(num_blocks, table[-1], preemptions)
        return False, num_blocks - sent

    def _add_inputs(self, seq: Sequence, start: int, n: int, inputs: _Inputs) -> None:
        """The step's `n` input ids of `seq` from position `start`; the last one is deferred when it is
        the token the previous step is sampling. Called per sequence per step: a decode input is one
        append, not a slice."""
        token_ids = seq.token_ids
        num_known = len(token_ids) - start
        if n == 1 and num_known > 0:  # a decode step of a known token
            inputs.ids.append(token_ids[start])
            return
        known = token_ids[start : start + n]
        inputs.ids.extend(known)
        if len(known) < n:  # the last input is the token the previous step is sampling
            row = self._sample_rows.get(seq.seq_id)
            if len(known) != n - 1 or row is None:
                raise RuntimeError(f"seq {seq.seq_id}: {n - len(known)} unknown inputs, previous step "
                                   f"sampled {'no' if row is None else 'one'} token for it")
            inputs.deferred_positions.append(len(inputs.ids))
            inputs.deferred_rows.append(row)
            inputs.ids.append(0)


@dataclass
class _Inputs:
    """A plan's input ids as they are gathered, and which of them the previous step's tokens fill."""

    ids: list[int] = field(default_factory=list)
    deferred_positions: list[int] = field(default_factory=list)
    deferred_rows: list[int] = field(default_factory=list)


def _prompt_logits(output: ScheduleOutput) -> np.ndarray:
    """Per sequence, how many rows also need logits for prompt logprobs; empty unless some request of
    the step asked for them."""
    if any(s.params.prompt_logprobs is not None for s in output.seqs):
        prompt_counts = [prompt_logit_count(s, start, n) for s, start, n in
                         zip(output.seqs, output.num_computed_before, output.num_new_tokens)]
        if any(prompt_counts):
            return np.asarray(prompt_counts, dtype=np.int32)
    return _empty(np.int32)
