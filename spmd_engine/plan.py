"""StepPlan: the whole per-step contract between rank 0 (scheduler) and every rank (forward).

Rank 0 builds one plan per step and broadcasts it with `broadcast_object_list`; every rank,
rank 0 included, turns the same plan into the same forward inputs. To stay small at large
batches the plan carries block-table *deltas*: every rank keeps a `BlockTableMirror` that the
plans update, so a decode step ships a few bytes per sequence instead of whole tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

COMMAND_FORWARD = "forward"
COMMAND_STOP = "stop"


def _empty(dtype) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


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
    # test-only fault injection (issue: faults across ranks); None in normal runs
    fault: dict | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.num_seqs > 0 and bool(np.all(self.query_lens == 1))
