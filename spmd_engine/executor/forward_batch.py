"""ForwardBatch: a StepPlan turned into the model's device inputs, identically on every rank.

All index arithmetic is vectorised numpy on the host (no per-sequence Python loops), then each
array is copied to the device once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from spmd_engine.models.attention_metadata import AttentionMetadata
from spmd_engine.core.plan import StepPlan


@dataclass
class HostBatch:
    """The host-side arrays of one step (kept separate so CUDA graphs can copy them into static buffers)."""

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
    # inputs the previous step sampled (see StepPlan): filled on the device before the forward
    deferred_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [D] int64
    deferred_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [D] int64

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    deferred_positions: torch.Tensor  # [D] int64, into input_ids
    deferred_rows: torch.Tensor  # [D] int64, into the previous step's sampled tokens

    def fill_deferred(self, prev_tokens: torch.Tensor | None) -> None:
        """Write the previous step's sampled tokens into the inputs waiting for them (no host sync)."""
        if self.deferred_positions.numel() == 0:
            return
        if prev_tokens is None:
            raise RuntimeError("the plan defers inputs to the previous step's tokens, but none were given")
        self.input_ids.index_copy_(0, self.deferred_positions, prev_tokens.index_select(0, self.deferred_rows))


def build_host_batch(plan: StepPlan, block_tables: np.ndarray, block_size: int) -> HostBatch:
    if plan.is_decode:
        return _decode_host_batch(plan, block_tables, block_size)
    q = plan.query_lens.astype(np.int64)
    cu = np.zeros(len(q) + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    total = int(cu[-1])
    seq_index = np.repeat(np.arange(len(q)), q)
    offset_in_seq = np.arange(total, dtype=np.int64) - cu[:-1][seq_index]
    positions = plan.num_computed.astype(np.int64)[seq_index] + offset_in_seq
    blocks = block_tables[seq_index, positions // block_size].astype(np.int64)
    slot_mapping = blocks * block_size + positions % block_size
    seq_lens = (plan.num_computed + plan.query_lens).astype(np.int32)
    logits_indices = cu[1:][plan.sample] - 1
    return HostBatch(
        input_ids=plan.input_ids.astype(np.int64),
        positions=positions,
        slot_mapping=slot_mapping,
        cu_seqlens_q=cu.astype(np.int32),
        seq_lens=seq_lens,
        block_tables=block_tables,
        logits_indices=logits_indices.astype(np.int64),
        max_query_len=int(q.max()) if len(q) else 0,
        max_seq_len=int(seq_lens.max()) if len(q) else 0,
        is_decode=plan.is_decode,
        deferred_positions=plan.deferred_positions.astype(np.int64),
        deferred_rows=plan.deferred_rows.astype(np.int64),
    )


def _decode_host_batch(plan: StepPlan, block_tables: np.ndarray, block_size: int) -> HostBatch:
    """One token per sequence: the same arrays without the varlen bookkeeping (the common step)."""
    num = plan.num_seqs
    positions = plan.num_computed.astype(np.int64)
    blocks = block_tables[np.arange(num), positions // block_size].astype(np.int64)
    seq_lens = (positions + 1).astype(np.int32)
    rows = np.arange(num + 1, dtype=np.int64)
    return HostBatch(
        input_ids=plan.input_ids.astype(np.int64),
        positions=positions,
        slot_mapping=blocks * block_size + positions % block_size,
        cu_seqlens_q=rows.astype(np.int32),
        seq_lens=seq_lens,
        block_tables=block_tables,
        logits_indices=rows[:-1][plan.sample],
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        is_decode=True,
        deferred_positions=plan.deferred_positions.astype(np.int64),
        deferred_rows=plan.deferred_rows.astype(np.int64),
    )


def to_device(host: HostBatch, block_size: int, device: torch.device) -> ForwardBatch:
    def put(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        if device.type == "cuda":
            return t.pin_memory().to(device, non_blocking=True)
        return t

    attn = AttentionMetadata(
        slot_mapping=put(host.slot_mapping),
        cu_seqlens_q=put(host.cu_seqlens_q),
        seq_lens=put(host.seq_lens),
        block_tables=put(host.block_tables),
        max_query_len=host.max_query_len,
        max_seq_len=host.max_seq_len,
        block_size=block_size,
        is_decode=host.is_decode,
    )
    return ForwardBatch(put(host.input_ids), put(host.positions), attn, put(host.logits_indices),
                        put(host.deferred_positions), put(host.deferred_rows))
