import numpy as np
import pytest
import torch

from spmd_engine.executor.forward_batch import build_host_batch, to_device
from spmd_engine.executor.input_buffers import InputBuffers
from spmd_engine.core.plan import StepPlan

CPU = torch.device("cpu")


def mixed_host():
    plan = StepPlan(step=0, seq_ids=np.array([10, 11, 12]), num_computed=np.array([3, 9, 0], dtype=np.int32),
                    query_lens=np.array([5, 1, 2], dtype=np.int32), input_ids=np.arange(8, dtype=np.int32),
                    sample=np.array([False, True, True]))
    return build_host_batch(plan, np.array([[7, 2, 0], [4, 5, 6], [1, 0, 0]], dtype=np.int32), block_size=4)


def decode_host(num_seqs):
    plan = StepPlan(step=1, seq_ids=np.arange(num_seqs), num_computed=np.arange(num_seqs, dtype=np.int32) + 5,
                    query_lens=np.ones(num_seqs, dtype=np.int32), input_ids=np.arange(num_seqs, dtype=np.int32) + 40,
                    sample=np.ones(num_seqs, dtype=bool))
    tables = np.arange(num_seqs * 3, dtype=np.int32).reshape(num_seqs, 3) + 1
    return build_host_batch(plan, tables, block_size=4)


def as_lists(batch):
    a = batch.attn
    return [t.tolist() for t in (batch.input_ids, batch.positions, a.slot_mapping, a.cu_seqlens_q, a.seq_lens,
                                 a.block_tables, batch.logits_indices)] + [a.max_query_len, a.max_seq_len, a.is_decode]


def test_load_matches_a_fresh_copy_and_reuses_the_same_memory():
    buffers = InputBuffers(max_tokens=16, max_seqs=4, max_blocks=3, block_size=4, device=CPU)
    host = mixed_host()
    first = buffers.load(host)
    assert as_lists(first) == as_lists(to_device(host, 4, CPU))
    second = buffers.load(decode_host(2))
    assert second.input_ids.data_ptr() == first.input_ids.data_ptr()
    assert second.attn.block_tables.data_ptr() == first.attn.block_tables.data_ptr()
    assert second.input_ids.tolist() == [41, 40] and second.attn.seq_lens.tolist() == [7, 6]  # longest first


def test_padded_decode_rows_store_nothing_and_read_nothing():
    buffers = InputBuffers(max_tokens=16, max_seqs=8, max_blocks=3, block_size=4, device=CPU)
    buffers.load(mixed_host())  # leaves other values behind in the rows that padding reuses
    batch = buffers.load(decode_host(3), rows=8)
    a = batch.attn
    assert batch.input_ids.shape == (8,) and a.block_tables.shape == (8, 3)
    assert a.slot_mapping[3:].tolist() == [-1] * 5 and a.seq_lens[3:].tolist() == [0] * 5
    assert a.cu_seqlens_q.tolist() == list(range(9))
    # a graph gathers logits_indices[:8]: the plan's rows (in the batch longest first), then the padding rows
    assert batch.logits_indices.tolist() == [2, 1, 0, 3, 4, 5, 6, 7] and a.is_decode


def test_only_decode_batches_pad_and_capacity_is_checked():
    buffers = InputBuffers(max_tokens=6, max_seqs=4, max_blocks=3, block_size=4, device=CPU)
    with pytest.raises(ValueError, match="only a decode batch can be padded"):
        buffers.load(mixed_host(), rows=4)
    assert not buffers.fits(mixed_host())  # 8 tokens > 6
    assert buffers.fits(decode_host(4)) and not buffers.fits(decode_host(5))


def test_deferred_inputs_are_staged_and_filled_in_the_buffer():
    import dataclasses

    buffers = InputBuffers(max_tokens=16, max_seqs=4, max_blocks=3, block_size=4, device=CPU)
    host = dataclasses.replace(decode_host(3), feed_rows=np.array([1, -1, 0]))
    assert host.num_fed == 2
    batch = buffers.load(host, rows=4)
    assert batch.feed_rows.tolist() == [1, -1, 0, -1] and batch.num_fed == 2  # the padded row: -1, fed nothing
    batch.fill_deferred(torch.tensor([90, 91]))
    assert batch.input_ids.tolist() == [91, 41, 90, 0]  # the padded row keeps token 0
