import numpy as np
import pytest

from spmd_engine.executor.forward_batch import build_host_batch
from spmd_engine.core.plan import StepPlan


def test_mixed_prefill_chunk_and_decodes():
    # seq A: 3 cached tokens + a 5-token chunk that does not finish the prompt (no sample)
    # seq B: decode at position 9; seq C: fresh 2-token prompt (samples)
    plan = StepPlan(step=0, seq_ids=np.array([10, 11, 12]), num_computed=np.array([3, 9, 0], dtype=np.int32),
                    query_lens=np.array([5, 1, 2], dtype=np.int32), input_ids=np.arange(8, dtype=np.int32),
                    sample=np.array([False, True, True]))
    tables = np.array([[7, 2, 0], [4, 5, 6], [1, 0, 0]], dtype=np.int32)
    hb = build_host_batch(plan, tables, block_size=4)
    # batch order: the decode B first (attention's decode slice), then A, C
    assert hb.num_decode_seqs == 1
    assert hb.input_ids.tolist() == [5, 0, 1, 2, 3, 4, 6, 7]
    assert hb.positions.tolist() == [9, 3, 4, 5, 6, 7, 0, 1]
    # slot = table[pos // 4] * 4 + pos % 4
    assert hb.slot_mapping.tolist() == [6 * 4 + 1, 7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 4, 5]
    assert hb.cu_seqlens_q.tolist() == [0, 1, 6, 8]
    assert hb.seq_lens.tolist() == [10, 8, 2]
    assert hb.block_tables.tolist() == [[4, 5, 6], [7, 2, 0], [1, 0, 0]]
    assert hb.logits_indices.tolist() == [0, 7]  # B then C: the plan's order of sampled sequences
    assert hb.token_rows.tolist() == [1, 2, 3, 4, 5, 0, 6, 7]
    assert (hb.max_query_len, hb.max_seq_len, hb.is_decode) == (5, 10, False)


def test_decode_first_plan_keeps_its_order():
    query_lens = np.array([1, 1, 3], dtype=np.int32)
    plan = StepPlan(step=0, seq_ids=np.arange(3), num_computed=np.array([9, 4, 0], dtype=np.int32),
                    query_lens=query_lens, input_ids=np.arange(5, dtype=np.int32), sample=np.ones(3, dtype=bool))
    tables = np.arange(9, dtype=np.int32).reshape(3, 3)
    hb = build_host_batch(plan, tables, block_size=4)
    assert hb.token_rows is None and hb.num_decode_seqs == 2
    assert hb.input_ids.tolist() == [0, 1, 2, 3, 4] and hb.logits_indices.tolist() == [0, 1, 4]
    assert hb.block_tables is tables


def test_pure_decode_step_is_flagged_and_runs_longest_first():
    """The longer context first in the batch (the decode kernel starts rows in batch order); logits row j
    is still the plan's j-th sequence."""
    plan = StepPlan(step=3, seq_ids=np.array([1, 2]), num_computed=np.array([4, 7], dtype=np.int32),
                    query_lens=np.array([1, 1], dtype=np.int32), input_ids=np.array([5, 6], dtype=np.int32),
                    sample=np.array([True, True]))
    hb = build_host_batch(plan, np.array([[0, 1], [2, 3]], dtype=np.int32), block_size=4)
    assert hb.is_decode and hb.positions.tolist() == [7, 4] and hb.slot_mapping.tolist() == [15, 4]
    assert hb.input_ids.tolist() == [6, 5] and hb.seq_lens.tolist() == [8, 5]
    assert hb.block_tables.tolist() == [[2, 3], [0, 1]]
    assert hb.logits_indices.tolist() == [1, 0] and hb.token_rows.tolist() == [1, 0]


def test_decode_rows_order_by_length_ties_in_plan_order_prompt_chunks_after():
    from spmd_engine.executor.forward_batch import batch_order

    query_lens = np.array([1, 3, 1, 1, 2, 1])
    seq_lens = np.array([5, 9, 8, 5, 40, 12])
    assert batch_order(query_lens, seq_lens).tolist() == [5, 2, 0, 3, 1, 4]
    assert batch_order(np.array([1, 1, 4]), np.array([9, 9, 3])) is None  # already in that order


def test_deferred_inputs_are_filled_from_the_previous_steps_tokens():
    import torch

    from spmd_engine.executor.forward_batch import to_device

    plan = StepPlan(step=4, seq_ids=np.array([1, 2, 3]), num_computed=np.array([4, 7, 0], dtype=np.int32),
                    query_lens=np.array([1, 1, 2], dtype=np.int32), input_ids=np.array([0, 6, 8, 9], dtype=np.int32),
                    sample=np.array([True, True, True]), deferred_positions=np.array([0], dtype=np.int32),
                    deferred_rows=np.array([2], dtype=np.int32), num_prev_sampled=3)
    host = build_host_batch(plan, np.array([[0, 1], [2, 3], [4, 0]], dtype=np.int32), block_size=4)
    assert host.feed_rows.tolist() == [-1, 2, -1, -1]  # where each input comes from, in batch order
    batch = to_device(host, 4, torch.device("cpu"))
    batch.fill_deferred(torch.tensor([70, 71, 72]))
    assert batch.input_ids.tolist() == [6, 72, 8, 9]  # batch order: the decodes longest first (8, 5), then the chunk
    with pytest.raises(RuntimeError, match="none were given"):
        batch.fill_deferred(None)


def test_deferred_inputs_follow_a_reordered_decode():
    """A decode behind a prompt chunk moves to the front; its deferred input moves with it."""
    import torch

    from spmd_engine.executor.forward_batch import to_device

    plan = StepPlan(step=4, seq_ids=np.array([3, 1]), num_computed=np.array([0, 4], dtype=np.int32),
                    query_lens=np.array([2, 1], dtype=np.int32), input_ids=np.array([8, 9, 0], dtype=np.int32),
                    sample=np.array([True, True]), deferred_positions=np.array([2], dtype=np.int32),
                    deferred_rows=np.array([1], dtype=np.int32), num_prev_sampled=2)
    host = build_host_batch(plan, np.array([[4, 0], [0, 1]], dtype=np.int32), block_size=4)
    batch = to_device(host, 4, torch.device("cpu"))
    assert batch.attn.num_decode_seqs == 1
    batch.fill_deferred(torch.tensor([70, 71]))
    assert batch.input_ids.tolist() == [71, 8, 9]
    assert batch.positions.tolist() == [4, 0, 1] and host.logits_indices.tolist() == [2, 0]
