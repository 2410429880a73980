"""BlockTableMirror: every rank's copy of the block tables, rebuilt from the StepPlan's deltas.

Why in the executor: rank 0's scheduler owns the tables; the mirror is what every rank's forward
reads them from (see docs/ARCHITECTURE.md, "The plan is small").
"""
from __future__ import annotations

import numpy as np

from spmd_engine.core.plan import StepPlan


class BlockTableMirror:
    """Every rank: the block tables rebuilt from plan deltas, identical to rank 0's on every rank."""

    def __init__(self, max_blocks: int, block_size: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.max_blocks = max_blocks
        self.block_size = block_size
        self._rows: dict[int, np.ndarray] = {}  # seq_id -> [max_blocks] int32, zero padded
        self._lens: dict[int, int] = {}

    @property
    def num_tables(self) -> int:
        return len(self._rows)

    def tables(self) -> dict[int, list[int]]:
        """Every table held (seq_id -> block ids): for tests and diagnostics, not the step path."""
        return {sid: row[: self._lens[sid]].tolist() for sid, row in self._rows.items()}

    def apply(self, plan: StepPlan) -> np.ndarray:
        """Apply drops, resets and appends; return this step's tables [B, max_blocks] int32 (0-padded).

        Raises if a table does not cover the KV slots the step writes and reads: the padding would
        otherwise send them to block 0, silently."""
        for sid in plan.dropped_seq_ids.tolist():
            self._rows.pop(sid, None)
            self._lens.pop(sid, None)
        offset = 0
        seq_ids = plan.seq_ids.tolist()
        for sid, reset, count in zip(seq_ids, plan.reset_tables.tolist(), plan.new_block_counts.tolist()):
            if reset:
                self._rows[sid] = np.zeros(self.max_blocks, dtype=np.int32)
                self._lens[sid] = 0
            elif sid not in self._rows:
                raise RuntimeError(f"step {plan.step}: seq {sid} has no block table and no reset")
            if count:
                start = self._lens[sid]
                if start + count > self.max_blocks:
                    raise RuntimeError(f"step {plan.step}: seq {sid} needs {start + count} blocks > {self.max_blocks}")
                self._rows[sid][start : start + count] = plan.new_block_ids[offset : offset + count]
                self._lens[sid] = start + count
                offset += count
        if offset != plan.new_block_ids.shape[0]:
            raise RuntimeError(f"step {plan.step}: {plan.new_block_ids.shape[0]} new block ids, used {offset}")
        if not seq_ids:
            return np.zeros((0, self.max_blocks), dtype=np.int32)
        # int32 is enough: a table holds at most max_model_len tokens
        lens = np.fromiter(map(self._lens.__getitem__, seq_ids), dtype=np.int32, count=len(seq_ids))
        tokens = plan.num_computed + plan.query_lens
        if (lens * self.block_size < tokens).any():
            self._raise_short(plan, lens, tokens)
        return np.stack([self._rows[sid] for sid in seq_ids])

    def _raise_short(self, plan: StepPlan, lens: np.ndarray, tokens: np.ndarray) -> None:
        b = int(np.flatnonzero(lens * self.block_size < tokens)[0])
        raise RuntimeError(
            f"step {plan.step}: seq {int(plan.seq_ids[b])}: this rank's block table holds {int(lens[b])} "
            f"blocks of {self.block_size} tokens, but the step covers {int(tokens[b])} tokens; the "
            f"block tables are out of step with the scheduler's")
