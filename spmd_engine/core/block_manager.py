"""Paged-KV block allocator with reference counts and prefix caching (rank 0 only).

Full blocks whose KV has been computed are indexed by a chained hash of their tokens, so a new
sequence with the same prefix reuses them instead of recomputing. Freed blocks keep their hash
and contents in an LRU free queue until they are handed out again.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np
import xxhash

from spmd_engine.core.sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: Seq[int]) -> int:
    """xxhash64 over the parent block's hash and this block's token ids (the chain makes it a prefix hash)."""
    return hash_block_bytes(parent_hash, np.asarray(token_ids, dtype=np.int64).tobytes())


def hash_block_bytes(parent_hash: int | None, data: bytes) -> int:
    """`hash_block` of a block whose token ids are already int64 bytes: xxh64 of the parent's 8 bytes
    (little-endian) then the ids', in one shot."""
    return xxhash.xxh64_intdigest(data if parent_hash is None else parent_hash.to_bytes(8, "little") + data)


@dataclass
class Block:
    """One KV block's bookkeeping; hash/tokens are set only while it is a registered cached block."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    """Hands out KV blocks to sequences and shares computed full prefix blocks between them."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref_count == 0 blocks; front = next to hand out (least recently freed, or holding nothing)
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        # seq_id -> (full blocks already hashed, hash of the last of them): where the chain continues
        self._chain: dict[int, tuple[int, int | None]] = {}
        self.prefix_cache_queries = 0  # tokens looked up at admissions
        self.prefix_cache_hits = 0  # of those, tokens found cached

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def is_cached(self, block_id: int) -> bool:
        """True if the block is the registered holder of its hash (a prefix hit can return it)."""
        block = self.blocks[block_id]
        return block.hash is not None and self._hash_to_block.get(block.hash) == block_id

    def allocate_prefix(self, seq: Sequence, use_cache: bool = True) -> int:
        """Give a newly admitted sequence the cached blocks of its longest computed prefix.

        Never matches the block holding the last token, so at least one token is computed (the
        forward must produce logits for it). Sets num_computed_tokens and num_cached_tokens and
        returns the number of cached tokens.
        """
        if seq.block_table:
            raise RuntimeError(f"seq {seq.seq_id} already holds blocks; allocate_prefix is for admission")
        num_hit_blocks, parent = 0, None
        if self.enable_prefix_caching and use_cache:  # not: every position must be computed (prompt logprobs)
            for block_id, block_hash in self._cached_prefix(seq):
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self._free[block_id]
                block.ref_count += 1
                seq.block_table.append(block_id)
                num_hit_blocks, parent = num_hit_blocks + 1, block_hash
            self._chain[seq.seq_id] = (num_hit_blocks, parent)
        return self._admitted_with(seq, num_hit_blocks * self.block_size)

    def fork_prefix(self, seq: Sequence, source: Sequence, num_tokens: int) -> tuple[int, int] | None:
        """Admit `seq` on the KV of `source`'s first `num_tokens` tokens (a sibling completion of the same
        prompt whose KV for them a step already queued), so the prompt is computed once.

        Full blocks are shared by reference count: either sequence may be preempted or finish without
        freeing the other's KV. A partial last block cannot be shared (both would write past it), so it
        is copied into a fresh block: returns that copy (source block, new block) for the step plan, or
        None. Without a free block for the copy, `seq` shares only the full blocks. Works with or without
        prefix caching (the blocks need not be registered yet); sets num_computed_tokens and
        num_cached_tokens."""
        if seq.block_table:
            raise RuntimeError(f"seq {seq.seq_id} already holds blocks; fork_prefix is for admission")
        num_full, partial = divmod(num_tokens, self.block_size)
        if num_tokens >= seq.num_tokens or len(source.block_table) < num_full + (partial > 0):
            raise RuntimeError(f"seq {seq.seq_id}: cannot share {num_tokens} tokens of seq {source.seq_id}")
        for block_id in source.block_table[:num_full]:
            self.blocks[block_id].ref_count += 1  # held by `source`: never in the free queue
        seq.block_table = source.block_table[:num_full]
        copy = None
        if partial and self.ensure_slots(seq, num_full * self.block_size + 1):
            copy = (source.block_table[num_full], seq.block_table[num_full])
        if self.enable_prefix_caching:
            self._chain[seq.seq_id] = (0, None)  # its first completed block re-derives the chain (hits, no copy)
        self._admitted_with(seq, num_tokens if copy else num_full * self.block_size)
        return copy

    def _admitted_with(self, seq: Sequence, num_tokens: int) -> int:
        """An admission's accounting: `seq` starts with `num_tokens` tokens of KV it did not compute."""
        seq.num_computed_tokens = num_tokens
        seq.num_cached_tokens = num_tokens
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += num_tokens
        return num_tokens

    def num_tokens_to_compute(self, seq: Sequence, use_cache: bool = True) -> int:
        """What `allocate_prefix(seq, use_cache)` now would leave to compute: its tokens past the cached
        prefix (nothing changes)."""
        hits = sum(1 for _ in self._cached_prefix(seq)) if self.enable_prefix_caching and use_cache else 0
        return seq.num_tokens - hits * self.block_size

    def _cached_prefix(self, seq: Sequence) -> Iterator[tuple[int, int]]:
        """(block id, hash) of each cached block of `seq`'s prefix, in order; never the block holding
        its last token (the forward must compute at least one token, for its logits)."""
        parent = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            block_hash = hash_block(parent, tokens)
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                return
            block = self.blocks[block_id]
            # collision guard: same tokens at the same place in the chain, not just the same hash
            if block.parent_hash != parent or block.token_ids != tuple(tokens):
                return
            yield block_id, block_hash
            parent = block_hash

    def undo_prefix(self, seq: Sequence) -> None:
        """Take back an admission that could not get blocks for its first chunk (and its counters)."""
        self.prefix_cache_queries -= seq.num_tokens
        self.prefix_cache_hits -= seq.num_cached_tokens
        self.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0

    def ensure_slots(self, seq: Sequence, num_tokens_total: int) -> bool:
        """Append blocks so the table covers `num_tokens_total` tokens; False (no change) if short."""
        held = len(seq.block_table)
        if num_tokens_total <= held * self.block_size:  # the common case: asked for every running sequence
            return True
        needed = self.blocks_needed(num_tokens_total) - held
        if needed <= 0:
            return True
        if needed > len(self._free):
            return False
        for _ in range(needed):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict: its old contents are about to be overwritten
                if self._hash_to_block.get(block.hash) == block_id:
                    del self._hash_to_block[block.hash]
                block.hash, block.parent_hash, block.token_ids = None, None, ()
            block.ref_count = 1
            seq.block_table.append(block_id)
        return True

    @property
    def hash_chains(self) -> dict[int, tuple[int, int | None]]:
        """seq_id -> (its leading blocks whose hashes are registered, the last one's hash); read-only:
        lets a caller skip `cache_full_blocks` for a sequence that completed no block (most of them)."""
        return self._chain

    def cache_full_blocks(self, seq: Sequence, num_computed: int) -> None:
        """Register the hashes of the sequence's full blocks among its first `num_computed` tokens,
        whose KV a finished step has written.

        Call after every step, never at allocation: a block still waiting for a later prefill chunk
        (or a step still on the device) must not be found by another sequence.
        """
        if not self.enable_prefix_caching:
            return
        num_hashed, parent = self._chain.get(seq.seq_id, (0, None))
        num_full = min(num_computed, len(seq.token_ids)) // self.block_size
        num_full = min(num_full, len(seq.block_table))
        if num_full <= num_hashed:  # most steps of most sequences complete no block (called per sequence)
            return
        size = self.block_size
        # the blocks' token bytes in one conversion (a prefill chunk completes tens of blocks), each
        # block's hash `hash_block`'s
        raw = np.asarray(seq.token_ids[num_hashed * size : num_full * size], dtype=np.int64).tobytes()
        width = 8 * size
        for i in range(num_hashed, num_full):
            tokens = tuple(seq.token_ids[i * size : (i + 1) * size])
            data = raw[(i - num_hashed) * width : (i - num_hashed + 1) * width]
            block_hash = hash_block_bytes(parent, data)
            block_id = seq.block_table[i]
            block = self.blocks[block_id]
            if block_hash not in self._hash_to_block and block.hash is None:
                block.hash, block.parent_hash, block.token_ids = block_hash, parent, tokens
                self._hash_to_block[block_hash] = block_id
            # else: an identical block computed by another sequence is already the cached copy
            parent = block_hash
        self._chain[seq.seq_id] = (num_full, parent)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks reaching 0 go to the free queue.

        Cached blocks join the back (reused last, so a later identical prefix still hits them),
        tail first so the shared beginning of a prefix outlives its end; blocks holding nothing
        reusable join the front.
        """
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            if block.ref_count == 0:
                self._free[block_id] = None
                if not self.is_cached(block_id):
                    self._free.move_to_end(block_id, last=False)
        seq.block_table = []
        self._chain.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> int:
        """Forget every registered block hash, so no later admission reuses KV computed before now (new
        weights, or a cache freed and allocated again); returns how many were dropped. Reference counts,
        tables and the hit counters stay: a sequence still holding blocks keeps them, but registers none
        of its later blocks either (their KV reads its earlier, stale blocks; hashes depend on tokens only)."""
        dropped = len(self._hash_to_block)
        for block in self.blocks:
            block.hash, block.parent_hash, block.token_ids = None, None, ()
        self._hash_to_block.clear()
        for seq_id in self._chain:  # a chain length no sequence reaches: `cache_full_blocks` registers nothing
            self._chain[seq_id] = (1 << 62, None)
        return dropped
