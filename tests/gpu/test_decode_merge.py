"""The fused split merge of the decode attention on CUDA: the last split program of each (sequence, KV
head) merges the partials (an acq_rel arrival counter) with the same bits as the oracle's second launch
(tests/helpers/split_oracles.py), under thousands of concurrent programs, back-to-back launches and
CUDA-graph replays with new lengths."""
from __future__ import annotations

import pytest
import torch

from spmd_engine.kernels.decode_attention import MAX_SPLITS, merge_counters, paged_decode_attention
from tests.gpu.engine_setup import GPU
from tests.helpers.split_oracles import second_launch_reductions
from tests.kernels.paged_batch import make_paged_batch, rel_error

pytestmark = GPU
BF16, FP16 = torch.bfloat16, torch.float16

# (seq_lens, block_size, Hq, Hkv, head_dim, dtype, num_splits (None = by shape), fp8 cache)
CASES = [
    pytest.param([600], 16, 16, 8, 128, BF16, None, False, id="qwen3-b1-ctx600-auto"),
    pytest.param([1 + 23 * i for i in range(64)], 16, 16, 8, 128, BF16, 8, False, id="b64-split8"),
    pytest.param([1500 - 21 * i for i in range(64)], 16, 16, 8, 128, BF16, 16, False, id="b64-split16"),
    pytest.param([700 + 11 * i for i in range(64)], 256, 16, 8, 128, BF16, 8, True, id="b64-split8-fp8"),
    pytest.param([1, 4096, 17, 2048], 32, 64, 8, 64, FP16, 7, False, id="gqa8-hd64-split7"),
    pytest.param([3000, 100], 16, 8, 8, 256, BF16, None, False, id="hd256-auto"),
    pytest.param([2048, 5, 0, 1024], 16, 32, 4, 128, BF16, MAX_SPLITS, False, id="max-splits"),
]


def _decode(batch, seq_lens, out, **kwargs):
    return paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, seq_lens, batch.block_tables,
                                  batch.scale, out=out, k_scale=batch.k_scale, v_scale=batch.v_scale, **kwargs)


def _second_launch(batch, seq_lens, **kwargs):
    """The split kernel's partials merged by the oracle's second launch."""
    with second_launch_reductions() as second:
        out = _decode(batch, seq_lens, torch.empty_like(batch.query), **kwargs)
    assert second.names == ["_decode_split_kernel"]
    return out


@pytest.mark.parametrize("seq_lens,block_size,hq,hkv,head_dim,dtype,num_splits,kv_fp8", CASES)
def test_fused_merge_equals_the_second_launch(seq_lens, block_size, hq, hkv, head_dim, dtype, num_splits, kv_fp8):
    """200 fused launches back to back (no sync between: each must see the counters the previous one
    reset), every one bitwise the two-launch result."""
    batch = make_paged_batch([1] * len(seq_lens), seq_lens, block_size, hq, hkv, head_dim, dtype, kv_fp8=kv_fp8)
    two = _second_launch(batch, batch.seq_lens, num_splits=num_splits)
    assert rel_error(two, batch.reference()) < (2e-3 if dtype == FP16 else 1e-2)
    out = torch.empty_like(batch.query)
    runs = [_decode(batch, batch.seq_lens, out, num_splits=num_splits).clone() for _ in range(200)]
    torch.cuda.synchronize()
    mismatches = [i for i, run in enumerate(runs) if not torch.equal(run, two)]
    assert not mismatches, (f"{len(mismatches)} of 200 fused launches differ from the second launch, "
                            f"first {mismatches[0]}")
    assert not merge_counters(batch.query.device).any()


@pytest.mark.parametrize("num_seqs,num_splits", [(64, 8), (64, 16), (1, None)],
                         ids=["b64-split8", "b64-split16", "b1-auto"])
def test_fused_merge_in_a_cuda_graph_follows_new_seq_lens(num_seqs, num_splits):
    """Captured once (counters and all), replayed several times per set of lengths: each replay is
    bitwise the eager two-launch result for those lengths, and the counters end at zero."""
    batch = make_paged_batch([1] * num_seqs, [2048] * num_seqs, 16, 16, 8, 128, BF16, seed=4)
    seq_lens = batch.seq_lens.clone()
    out = torch.empty_like(batch.query)

    def step():
        _decode(batch, seq_lens, out, num_splits=num_splits)

    step()  # compile and allocate the counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    rows = range(num_seqs)
    for lengths in ([2048] * num_seqs, [1 + 31 * i for i in rows], [0 if i % 2 else 700 for i in rows],
                    [2048 - 17 * i for i in rows], [5] * num_seqs):
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        expected = _second_launch(batch, seq_lens, num_splits=num_splits)
        for replay in range(4):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, expected), (lengths[:4], replay)
    assert not merge_counters(batch.query.device).any()
