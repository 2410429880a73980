"""ForwardBatch: a StepPlan turned into the model's device inputs, identically on every rank.

All index arithmetic is vectorised numpy on the host (no per-sequence Python loops), then each
array is copied to the device once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from spmd_engine.models.attention_metadata import AttentionMetadata
from spmd_engine.core.plan import StepPlan
from spmd_engine.executor.device_copy import to_device_async
from spmd_engine.kernels.reference import feed_tokens_reference


# What a field's length counts: the step's tokens T, its sequences B, B + 1, or B rows of max_blocks
TOKENS, SEQS, SEQS_PLUS_ONE, TABLE_ROWS = "tokens", "seqs", "seqs+1", "table_rows"


@dataclass(frozen=True)
class BatchField:
    """One host array of a step. Declared once: the host batch, the persistent input buffers (and so
    the CUDA graphs captured on them) and the start-up warm-up all take their layout from BATCH_FIELDS."""

    name: str
    dtype: type  # np.int64 | np.int32
    extent: str  # TOKENS | SEQS | SEQS_PLUS_ONE | TABLE_ROWS
    pad: int | None  # what a padding token / sequence holds (decode graphs); None: not a padded field

    def capacity(self, max_tokens: int, max_seqs: int, max_blocks: int) -> int:
        return {TOKENS: max_tokens, SEQS: max_seqs, SEQS_PLUS_ONE: max_seqs + 1,
                TABLE_ROWS: max_seqs * max_blocks}[self.extent]


BATCH_FIELDS: tuple[BatchField, ...] = (
    BatchField("input_ids", np.int64, TOKENS, 0),
    BatchField("positions", np.int64, TOKENS, 0),
    BatchField("slot_mapping", np.int64, TOKENS, -1),  # -1: the token's K/V is not stored
    BatchField("logits_indices", np.int64, SEQS, None),  # rows of the hidden states that get logits
    BatchField("feed_rows", np.int64, TOKENS, -1),  # -1: the plan's id; r: the previous step's sampled token r
    BatchField("cu_seqlens_q", np.int32, SEQS_PLUS_ONE, None),  # a padding sequence is one token
    BatchField("seq_lens", np.int32, SEQS, 0),  # 0: attention reads nothing for the row
    BatchField("block_tables", np.int32, TABLE_ROWS, 0),  # last: a copy stops after the rows in use
)


@dataclass
class HostBatch:
    """The host-side arrays of one step (kept separate so CUDA graphs can copy them into static buffers);
    the array fields are BATCH_FIELDS."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    cu_seqlens_q: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max_blocks] int32
    logits_indices: np.ndarray  # [num_sampled] int64: rows of the hidden states that get logits
    max_query_len: int
    max_seq_len: int
    is_decode: bool
    # [T] int64: where each input id comes from, -1 (input_ids) or row r of the previous step's sampled
    # tokens (StepPlan's deferred inputs, in batch order), written in on the device (kernels/feed_tokens.py);
    # None: nothing deferred
    feed_rows: np.ndarray | None = None
    # the first num_decode_seqs sequences have query length 1 (attention's decode slice)
    num_decode_seqs: int = 0
    # the plan's token i is row token_rows[i] of this batch (None: the same order)
    token_rows: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.feed_rows is None:
            self.feed_rows = np.full(self.input_ids.shape[0], -1, dtype=np.int64)

    @property
    def num_fed(self) -> int:
        """Inputs that take the previous step's sampled tokens."""
        return int(np.count_nonzero(self.feed_rows >= 0))

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def padding(cls, rows: int, max_blocks: int) -> HostBatch:
        """A decode batch of `rows` padding rows (nothing read or stored): the CUDA graphs' capture input."""
        arrays = {f.name: np.full((rows, max_blocks) if f.extent == TABLE_ROWS else rows, f.pad, dtype=f.dtype)
                  for f in BATCH_FIELDS if f.pad is not None}
        return cls(**arrays, cu_seqlens_q=np.arange(rows + 1, dtype=np.int32),
                   logits_indices=np.arange(rows, dtype=np.int64), max_query_len=1, max_seq_len=0, is_decode=True,
                   num_decode_seqs=rows)

    @classmethod
    def unstored_prefill(cls, seq_lens: list[int]) -> HostBatch:
        """Whole prefills of `seq_lens` tokens that store no K/V (padding ids and slots, one zero block
        table row each): the start-up warm-up that measures activation memory before the KV cache."""
        pads = {f.name: f for f in BATCH_FIELDS}
        q = np.asarray(seq_lens, dtype=np.int64)
        cu = np.zeros(len(q) + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])
        total = int(cu[-1])

        def padded(name: str, shape) -> np.ndarray:
            return np.full(shape, pads[name].pad, dtype=pads[name].dtype)

        return cls(input_ids=padded("input_ids", total), positions=np.concatenate([np.arange(n) for n in q]),
                   slot_mapping=padded("slot_mapping", total), cu_seqlens_q=cu.astype(np.int32),
                   seq_lens=q.astype(np.int32), block_tables=padded("block_tables", (len(q), 1)),
                   logits_indices=cu[1:] - 1, max_query_len=int(q.max()), max_seq_len=int(q.max()), is_decode=False)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    feed_rows: torch.Tensor  # [T] int64: HostBatch.feed_rows
    num_fed: int  # how many of feed_rows are >= 0 (known on the host)

    def fill_deferred(self, prev_tokens: torch.Tensor | None) -> None:
        """Write the previous step's sampled tokens into the inputs waiting for them (no host sync); a
        decode graph does this itself, from the runner's token feed (cuda_graphs.decode_step)."""
        if self.num_fed == 0:
            return
        if prev_tokens is None:
            raise RuntimeError("the plan defers inputs to the previous step's tokens, but none were given")
        self.feed_from(prev_tokens)

    def feed_from(self, feed: torch.Tensor) -> None:
        """input_ids[i] = feed[feed_rows[i]] wherever feed_rows[i] >= 0, in one launch on CUDA (what a
        decode graph records, whatever the step defers), the torch reference elsewhere."""
        if self.input_ids.is_cuda:
            from spmd_engine.kernels.feed_tokens import feed_tokens
            feed_tokens(self.input_ids, self.feed_rows, feed)
        else:
            feed_tokens_reference(self.input_ids, self.feed_rows, feed)


def batch_order(query_lens: np.ndarray, seq_lens: np.ndarray) -> np.ndarray | None:
    """The batch order of a plan's sequences; None when it is the plan's own.

    The query-length-1 ones first, so attention runs them as one contiguous decode slice, longest
    context first (ties in plan order): the decode kernel starts its programs in row order, and a step's
    contexts differ by up to 20x, so a long row started last would run on alone after the others
    (longest first, the short rows fill the tail). The prompt chunks follow in plan order. A row's
    bits do not depend on its place in the batch; the sampled rows (`logits_indices`) stay in plan order."""
    single = query_lens == 1
    key = np.where(single, -seq_lens.astype(np.int64), 1)  # decode rows by descending length, then the rest
    order = np.argsort(key, kind="stable")
    if (order == np.arange(len(order))).all():
        return None
    return order


def build_host_batch(plan: StepPlan, block_tables: np.ndarray, block_size: int) -> HostBatch:
    """The step's arrays in batch order (decode rows first, longest first: see `batch_order`); the
    sampled rows (`logits_indices`) stay in plan order, so logits row j is the plan's j-th sampled sequence."""
    num_computed = plan.num_computed.astype(np.int64)
    q_plan = plan.query_lens.astype(np.int64)
    order = batch_order(plan.query_lens, num_computed + q_plan)
    if plan.is_decode:
        return _decode_host_batch(plan, block_tables, block_size, order)
    q = q_plan if order is None else q_plan[order]
    if order is not None:
        num_computed, block_tables = num_computed[order], block_tables[order]
    cu = np.zeros(len(q) + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    total = int(cu[-1])
    seq_index = np.repeat(np.arange(len(q)), q)
    offset_in_seq = np.arange(total, dtype=np.int64) - cu[:-1][seq_index]
    positions = num_computed[seq_index] + offset_in_seq
    blocks = block_tables[seq_index, positions // block_size].astype(np.int64)
    slot_mapping = blocks * block_size + positions % block_size
    seq_lens = (num_computed + q).astype(np.int32)
    last_rows = cu[1:] - 1
    input_ids = plan.input_ids.astype(np.int64)
    deferred_positions = plan.deferred_positions.astype(np.int64)  # plan token order
    token_rows = None
    if order is not None:
        plan_starts = np.zeros(len(q), dtype=np.int64)
        np.cumsum(q_plan[:-1], out=plan_starts[1:])
        source = np.repeat(plan_starts[order] - cu[:-1], q) + np.arange(total, dtype=np.int64)  # plan token of row
        token_rows = np.empty(total, dtype=np.int64)
        token_rows[source] = np.arange(total, dtype=np.int64)
        input_ids = input_ids[source]
        deferred_positions = token_rows[deferred_positions]
        last_rows = last_rows[np.argsort(order)]  # back to plan order
    return HostBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        cu_seqlens_q=cu.astype(np.int32),
        seq_lens=seq_lens,
        block_tables=block_tables,
        logits_indices=last_rows[plan.sample].astype(np.int64),
        max_query_len=int(q.max()) if len(q) else 0,
        max_seq_len=int(seq_lens.max()) if len(q) else 0,
        is_decode=plan.is_decode,
        feed_rows=_feed_rows(total, deferred_positions, plan.deferred_rows),
        num_decode_seqs=int((q == 1).sum()),
        token_rows=token_rows,
    )


def _decode_host_batch(plan: StepPlan, block_tables: np.ndarray, block_size: int,
                       order: np.ndarray | None) -> HostBatch:
    """One token per sequence: the same arrays without the varlen bookkeeping (the common step).
    Sequence = token = row, so a reorder is one permutation (`order`: batch row -> plan row)."""
    num = plan.num_seqs
    positions = plan.num_computed.astype(np.int64)
    input_ids = plan.input_ids.astype(np.int64)
    rows = np.arange(num + 1, dtype=np.int64)
    plan_rows = rows[:-1]  # the batch row of each plan row
    if order is not None:
        positions, input_ids, block_tables = positions[order], input_ids[order], block_tables[order]
        plan_rows = np.empty(num, dtype=np.int64)
        plan_rows[order] = rows[:-1]
    blocks = block_tables[np.arange(num), positions // block_size].astype(np.int64)
    seq_lens = (positions + 1).astype(np.int32)
    return HostBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=blocks * block_size + positions % block_size,
        cu_seqlens_q=rows.astype(np.int32),
        seq_lens=seq_lens,
        block_tables=block_tables,
        logits_indices=plan_rows[plan.sample],
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        is_decode=True,
        feed_rows=_feed_rows(num, plan_rows[plan.deferred_positions.astype(np.int64)], plan.deferred_rows),
        num_decode_seqs=num,
        token_rows=None if order is None else plan_rows,
    )


def _feed_rows(num_tokens: int, positions: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """[T] int64: -1, and rows[i] at batch position positions[i] (StepPlan's deferred inputs)."""
    feed_rows = np.full(num_tokens, -1, dtype=np.int64)
    feed_rows[positions] = rows
    return feed_rows


def to_device(host: HostBatch, block_size: int, device: torch.device) -> ForwardBatch:
    def put(a: np.ndarray) -> torch.Tensor:
        return to_device_async(torch.from_numpy(np.ascontiguousarray(a)), device)

    attn = AttentionMetadata(
        slot_mapping=put(host.slot_mapping),
        cu_seqlens_q=put(host.cu_seqlens_q),
        seq_lens=put(host.seq_lens),
        block_tables=put(host.block_tables),
        max_query_len=host.max_query_len,
        max_seq_len=host.max_seq_len,
        block_size=block_size,
        is_decode=host.is_decode,
        num_decode_seqs=host.num_decode_seqs,
    )
    return ForwardBatch(put(host.input_ids), put(host.positions), attn, put(host.logits_indices),
                        put(host.feed_rows), host.num_fed)
