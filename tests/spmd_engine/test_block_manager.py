import numpy as np
import pytest

from spmd_engine.core import block_manager as bm_module
from spmd_engine.core.block_manager import BlockManager, hash_block, hash_block_bytes
from spmd_engine.core.sequence import Sequence

BS = 4


def computed(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> Sequence:
    """Pretend a forward computed the sequence's KV up to num_tokens (default: all of it)."""
    n = seq.num_tokens if num_tokens is None else num_tokens
    assert bm.ensure_slots(seq, n)
    seq.num_computed_tokens = n
    bm.cache_full_blocks(seq, seq.num_computed_tokens)
    return seq


def admit(bm: BlockManager, seq_id: int, tokens: list[int]) -> Sequence:
    seq = Sequence(seq_id, tokens)
    bm.allocate_prefix(seq)
    return seq


def test_hash_is_chained():
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert hash_block(1, [1, 2]) != hash_block(2, [1, 2])
    ids = np.arange(40, 48, dtype=np.int64)  # the one-shot form over int64 bytes is the same hash
    assert hash_block_bytes(2**63 + 5, ids.tobytes()) == hash_block(2**63 + 5, ids.tolist())


def test_ensure_slots_all_or_nothing():
    bm = BlockManager(3, BS, enable_prefix_caching=False)
    seq = Sequence(0, list(range(5)))
    assert bm.ensure_slots(seq, 5) and len(seq.block_table) == 2
    assert bm.ensure_slots(seq, 8) and len(seq.block_table) == 2  # already covered
    assert not bm.ensure_slots(seq, 13)  # needs 4 blocks, 3 exist
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 1
    assert bm.ensure_slots(seq, 12) and bm.num_free_blocks == 0
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 3
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_reference_counts_of_shared_prefix():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = computed(bm, admit(bm, 0, list(range(10))))  # blocks: 2 full + 1 partial
    b = admit(bm, 1, list(range(8)) + [50, 51, 52])
    assert b.num_computed_tokens == 8 == b.num_cached_tokens
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    computed(bm, b)
    assert b.block_table[2] != a.block_table[2]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    assert bm.num_free_blocks == 8 - 3
    bm.free(b)
    assert bm.num_free_blocks == 8 and all(blk.ref_count == 0 for blk in bm.blocks)
    holder = computed(bm, admit(bm, 2, [7] * 5))
    with pytest.raises(RuntimeError, match="already holds blocks"):
        bm.allocate_prefix(holder)


def test_block_is_registered_only_once_computed():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = admit(bm, 0, list(range(12)))
    assert bm.ensure_slots(a, 12)  # all slots allocated, but only the first chunk computed
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a, a.num_computed_tokens)
    assert admit(bm, 1, list(range(12))).num_computed_tokens == 4
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a, a.num_computed_tokens)
    assert admit(bm, 2, list(range(12)) + [1]).num_computed_tokens == 12


def test_full_hit_still_computes_the_last_token():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    computed(bm, admit(bm, 0, list(range(9))))  # two full blocks cached
    whole = admit(bm, 1, list(range(8)))  # prompt = exactly the two cached blocks
    assert whole.num_computed_tokens == 4 and len(whole.block_table) == 1
    one_more = admit(bm, 2, list(range(9)))
    assert one_more.num_computed_tokens == 8 and one_more.num_tokens - one_more.num_computed_tokens == 1
    tiny = admit(bm, 3, list(range(4)))
    assert tiny.num_computed_tokens == 0 and tiny.block_table == []


def test_hash_collision_guard(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 12345)
    monkeypatch.setattr(bm_module, "hash_block_bytes", lambda parent, data: 12345)  # cache_full_blocks's
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = computed(bm, admit(bm, 0, [1, 2, 3, 4, 5]))
    other = admit(bm, 1, [9, 9, 9, 9, 5])  # same (forced) hash, different tokens
    assert other.num_computed_tokens == 0 and other.block_table == []
    same = admit(bm, 2, [1, 2, 3, 4, 7])
    assert same.block_table == a.block_table[:1]
    # equal tokens at another place in the chain must not hit either (parent differs)
    shifted = admit(bm, 3, [1, 2, 3, 4, 1, 2, 3, 4, 0])
    assert shifted.block_table == a.block_table[:1] and shifted.num_computed_tokens == 4


def test_freed_blocks_still_hit_until_reused():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = computed(bm, admit(bm, 0, list(range(9))))
    cached = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = admit(bm, 1, list(range(9)))
    assert b.block_table == cached and b.num_cached_tokens == 8
    assert bm.num_free_blocks == 2  # the hit blocks left the free queue
    bm.free(b)
    # a fresh unrelated sequence takes the non-cached block first, then the least useful cached one
    c = Sequence(2, [70] * 9)
    assert bm.ensure_slots(c, 9)
    assert not set(c.block_table[:2]) & set(cached)
    assert c.block_table[2] == cached[1]  # tail of the cached prefix is evicted before its head
    d = admit(bm, 3, list(range(9)))
    assert d.block_table == cached[:1] and d.num_cached_tokens == 4


def test_lru_reuses_least_recently_freed_first():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    old = computed(bm, admit(bm, 0, [1] * 4 + [0]))
    new = computed(bm, admit(bm, 1, [2] * 4 + [0]))
    old_block, new_block = old.block_table[0], new.block_table[0]
    bm.free(old)
    bm.free(new)
    taker = Sequence(2, [3] * 12)
    assert bm.ensure_slots(taker, 12)
    assert old_block in taker.block_table and new_block not in taker.block_table
    assert admit(bm, 3, [2] * 4 + [0]).num_cached_tokens == 4
    assert admit(bm, 4, [1] * 4 + [0]).num_cached_tokens == 0


def test_evicted_block_no_longer_hits():
    bm = BlockManager(2, BS, enable_prefix_caching=True)
    a = computed(bm, admit(bm, 0, list(range(5))))
    bm.free(a)
    filler = Sequence(1, [9] * 8)
    assert bm.ensure_slots(filler, 8)  # takes both blocks, the cached one included
    bm.free(filler)
    again = computed(bm, admit(bm, 2, list(range(5))))
    assert again.num_cached_tokens == 0
    bm.free(again)  # computed once more: registered again under the same hash
    assert admit(bm, 3, list(range(5))).num_cached_tokens == 4


def test_blocks_holding_nothing_reusable_are_handed_out_first():
    bm = BlockManager(3, BS, enable_prefix_caching=True)
    a = computed(bm, admit(bm, 0, [1, 1, 1, 1]))  # one full, cached block
    b = computed(bm, admit(bm, 1, [2, 2]))  # one partial block, freed after a's
    cached_block = a.block_table[0]
    bm.free(a)
    bm.free(b)
    taker = Sequence(2, [3] * 8)
    assert bm.ensure_slots(taker, 8)
    assert cached_block not in taker.block_table and bm.is_cached(cached_block)
    bm.free(taker)
    assert admit(bm, 3, [1, 1, 1, 1, 5]).num_cached_tokens == 4


def test_duplicate_computation_keeps_one_cached_copy():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a, b = admit(bm, 0, list(range(6))), admit(bm, 1, list(range(10)))
    computed(bm, a)
    computed(bm, b)  # block 0 computed twice (both admitted in the same step)
    assert a.block_table[0] != b.block_table[0]
    assert bm.is_cached(a.block_table[0]) and not bm.is_cached(b.block_table[0])
    assert bm.is_cached(b.block_table[1])  # b's chain goes on past its duplicate block
    expected = [a.block_table[0], b.block_table[1]]
    bm.free(a)
    bm.free(b)
    c = admit(bm, 2, list(range(10)))
    assert c.block_table == expected and c.num_cached_tokens == 8


def test_hit_rate_counters_and_undo():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    computed(bm, admit(bm, 0, list(range(9))))
    b = admit(bm, 1, list(range(9)))
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (18, 8)
    assert bm.prefix_cache_hit_rate == pytest.approx(8 / 18)
    free_before = bm.num_free_blocks
    bm.undo_prefix(b)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (9, 0)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert bm.num_free_blocks == free_before  # shared blocks still held by seq 0


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    computed(bm, admit(bm, 0, list(range(9))))
    b = admit(bm, 1, list(range(9)))
    assert b.num_computed_tokens == 0 and b.block_table == []
    assert bm.prefix_cache_hit_rate == 0.0


@pytest.mark.parametrize("caching", [True, False])
def test_tokens_to_compute_is_what_admission_would_leave_and_changes_nothing(caching):
    """The engine counts waiting work with it before admitting more requests (engine._refill)."""
    bm = BlockManager(8, BS, enable_prefix_caching=caching)
    computed(bm, admit(bm, 0, list(range(10))))
    for tokens in (list(range(8)) + [50, 51, 52], list(range(8)), list(range(5)) + [60], [99] * 3):
        seq = Sequence(1, tokens)
        free, queries = bm.num_free_blocks, bm.prefix_cache_queries
        left = bm.num_tokens_to_compute(seq)
        assert (bm.num_free_blocks, bm.prefix_cache_queries, seq.block_table) == (free, queries, [])
        bm.allocate_prefix(seq)
        assert left == seq.num_tokens - seq.num_computed_tokens
        bm.free(seq)
    assert bm.num_tokens_to_compute(Sequence(2, list(range(9)))) == (1 if caching else 9)
    assert bm.num_tokens_to_compute(Sequence(2, list(range(9))), use_cache=False) == 9  # prompt logprobs


@pytest.mark.parametrize("caching", [True, False])
def test_fork_prefix_shares_full_blocks_and_copies_the_partial_one(caching):
    bm = BlockManager(6, BS, enable_prefix_caching=caching)
    first = computed(bm, admit(bm, 0, list(range(10))))  # 2 full blocks + 2 tokens in a third
    child = Sequence(1, list(range(10)))
    assert bm.fork_prefix(child, first, 9) == (first.block_table[2], child.block_table[2])
    assert child.block_table[:2] == first.block_table[:2] and child.block_table[2] != first.block_table[2]
    assert child.num_computed_tokens == 9 == child.num_cached_tokens
    assert [bm.blocks[i].ref_count for i in child.block_table] == [2, 2, 1]
    bm.free(first)  # the child keeps every block it holds
    assert [bm.blocks[i].ref_count for i in child.block_table] == [1, 1, 1] and bm.num_free_blocks == 3
    bm.free(child)
    # no free block for the copy: the full blocks only, the partial one is computed again
    first = computed(bm, admit(bm, 0, list(range(10))))
    filler = Sequence(2, list(range(100, 112)))
    assert bm.ensure_slots(filler, 12) and bm.num_free_blocks == 0
    child = Sequence(1, list(range(10)))
    assert bm.fork_prefix(child, first, 9) is None
    assert child.block_table == first.block_table[:2] and child.num_computed_tokens == 8
