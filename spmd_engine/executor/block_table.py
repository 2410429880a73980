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
        # one row per held table, zero padded; a step's tables are one gather of their rows (a stack of
        # per-sequence arrays cost ~90 us at batch 216, on every rank, every step)
        self._table = np.zeros((16, max_blocks), dtype=np.int32)
        self._lens = np.zeros(16, dtype=np.int32)
        self._row: dict[int, int] = {}  # seq_id -> its row
        self._free_rows: list[int] = list(range(15, -1, -1))  # popped from the end: lowest row first

    @property
    def num_tables(self) -> int:
        return len(self._row)

    def tables(self) -> dict[int, list[int]]:
        """Every table held (seq_id -> block ids): for tests and diagnostics, not the step path."""
        return {sid: self._table[r, : self._lens[r]].tolist() for sid, r in self._row.items()}

    def _new_row(self, sid: int) -> int:
        """A zeroed row for `sid` (its old one when it has one): the table of a reset sequence."""
        row = self._row.get(sid)
        if row is None:
            if not self._free_rows:
                self._grow()
            row = self._row[sid] = self._free_rows.pop()
        self._table[row] = 0
        self._lens[row] = 0
        return row

    def _grow(self) -> None:
        """Twice the rows (tables of new sequences beyond the rows held so far)."""
        n = self._table.shape[0]
        self._table = np.concatenate([self._table, np.zeros_like(self._table)])
        self._lens = np.concatenate([self._lens, np.zeros_like(self._lens)])
        self._free_rows.extend(range(2 * n - 1, n - 1, -1))

    def apply(self, plan: StepPlan) -> np.ndarray:
        """Apply drops, resets and appends; return this step's tables [B, max_blocks] int32 (0-padded).

        Raises if a table does not cover the KV slots the step writes and reads: the padding would
        otherwise send them to block 0, silently."""
        for sid in plan.dropped_seq_ids.tolist():
            row = self._row.pop(sid, None)
            if row is not None:
                self._free_rows.append(row)
        offset = 0
        seq_ids = plan.seq_ids.tolist()
        # only the sequences whose table changed are visited (per step a few of ~250 gain a block)
        changed = np.flatnonzero(plan.reset_tables | (plan.new_block_counts != 0))
        for b, reset, count in zip(changed.tolist(), plan.reset_tables[changed].tolist(),
                                   plan.new_block_counts[changed].tolist()):
            sid = seq_ids[b]
            row = self._new_row(sid) if reset else self._row.get(sid)
            if row is None:
                raise RuntimeError(f"step {plan.step}: seq {sid} has no block table and no reset")
            if count:
                start = int(self._lens[row])
                if start + count > self.max_blocks:
                    raise RuntimeError(f"step {plan.step}: seq {sid} needs {start + count} blocks > {self.max_blocks}")
                self._table[row, start : start + count] = plan.new_block_ids[offset : offset + count]
                self._lens[row] = start + count
                offset += count
        if offset != plan.new_block_ids.shape[0]:
            raise RuntimeError(f"step {plan.step}: {plan.new_block_ids.shape[0]} new block ids, used {offset}")
        if not seq_ids:
            return np.zeros((0, self.max_blocks), dtype=np.int32)
        try:
            rows = np.fromiter(map(self._row.__getitem__, seq_ids), dtype=np.int64, count=len(seq_ids))
        except KeyError as missing:  # an unchanged sequence the mirror holds no table of
            raise RuntimeError(f"step {plan.step}: seq {missing.args[0]} has no block table and no reset") from None
        # int32 is enough: a table holds at most max_model_len tokens
        lens = self._lens[rows]
        tokens = plan.num_computed + plan.query_lens
        if (lens * self.block_size < tokens).any():
            self._raise_short(plan, lens, tokens)
        return self._table[rows]

    def _raise_short(self, plan: StepPlan, lens: np.ndarray, tokens: np.ndarray) -> None:
        b = int(np.flatnonzero(lens * self.block_size < tokens)[0])
        raise RuntimeError(
            f"step {plan.step}: seq {int(plan.seq_ids[b])}: this rank's block table holds {int(lens[b])} "
            f"blocks of {self.block_size} tokens, but the step covers {int(tokens[b])} tokens; the "
            f"block tables are out of step with the scheduler's")
