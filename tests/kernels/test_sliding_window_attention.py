"""Sliding-window attention (a query sees its last W positions) in the Triton prefill, decode and mixed kernels
against the torch reference: windows shorter than the contexts, cached prefixes crossing them, windows
narrower than a key tile and wider than the sequence, several decode splits, an fp8 cache."""
import pytest
import torch

from spmd_engine.kernels.decode_attention import DecodeConfig, paged_decode_attention
from spmd_engine.kernels.mixed_attention import plan_paged_attention
from spmd_engine.kernels.prefill_attention import paged_prefill_attention
from spmd_engine.kernels.reference import paged_attention_reference
from tests.kernels.paged_batch import gpu_case, make_paged_batch, rel_error

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # triton interpreter noise
SPLITTING = DecodeConfig(block_n=16, num_warps=1, num_stages=1, programs_per_sm=64, min_tokens_per_split=16)


def reference(batch, window: int) -> torch.Tensor:
    return paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens,
                                     batch.block_tables, batch.scale, batch.k_scale, batch.v_scale, window=window)


# (query_lens, seq_lens, block_size, Hq, Hkv, head_dim, dtype, window, tol)
PREFILL = [
    pytest.param([20, 5, 1], [20, 45, 33], 8, 4, 2, 16, torch.float32, 6, 1e-5, id="w6-fp32"),
    pytest.param([33, 7], [50, 7], 16, 4, 1, 16, torch.float16, 20, 2e-3, id="w20-cached-fp16"),
    pytest.param([9, 3], [9, 30], 4, 2, 2, 32, torch.float32, 1, 1e-5, id="w1-self-only"),
    pytest.param([12], [12], 16, 2, 1, 16, torch.float32, 100, 1e-5, id="window-wider-than-sequence"),
    gpu_case([512, 300, 1], [8192, 700, 4000], 16, 4, 1, 256, torch.bfloat16, 512, 1e-2),
    gpu_case([1024] * 4, [8192] * 4, 16, 32, 8, 128, torch.bfloat16, 4096, 1e-2),
]


@pytest.mark.parametrize("query_lens,seq_lens,block_size,hq,hkv,head_dim,dtype,window,tol", PREFILL)
def test_prefill_matches_reference(query_lens, seq_lens, block_size, hq, hkv, head_dim, dtype, window, tol):
    batch = make_paged_batch(query_lens, seq_lens, block_size, hq, hkv, head_dim, dtype)
    out = paged_prefill_attention(batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens,
                                  batch.block_tables, batch.scale, batch.max_query_len, window=window)
    assert rel_error(out, reference(batch, window)) < tol
    assert rel_error(reference(batch, 0), reference(batch, window)) > 1e-3 or window >= max(seq_lens)


# (seq_lens, block_size, Hq, Hkv, head_dim, dtype, kv_fp8, window, num_splits, tol)
DECODE = [
    pytest.param([40, 7, 64], 8, 4, 2, 16, torch.float32, False, 10, None, 1e-5, id="w10-fp32"),
    pytest.param([90, 33], 4, 4, 1, 16, torch.float16, False, 50, 3, 2e-3, id="w50-3splits-fp16"),
    pytest.param([70, 5], 8, 2, 1, 16, torch.float32, False, 3, 4, 1e-5, id="w3-splits-past-window"),
    pytest.param([60, 17], 8, 4, 2, 32, torch.float16, True, 12, 2, 5e-2, id="w12-fp8-cache"),
    gpu_case([8192] * 8, 16, 4, 1, 256, torch.bfloat16, False, 512, None, 1e-2),
    gpu_case([300, 5000, 9000], 16, 32, 8, 128, torch.bfloat16, True, 4096, None, 5e-2),
]


@pytest.mark.parametrize("seq_lens,block_size,hq,hkv,head_dim,dtype,kv_fp8,window,num_splits,tol", DECODE)
def test_decode_matches_reference(seq_lens, block_size, hq, hkv, head_dim, dtype, kv_fp8, window, num_splits, tol):
    batch = make_paged_batch([1] * len(seq_lens), seq_lens, block_size, hq, hkv, head_dim, dtype, kv_fp8=kv_fp8)
    config = SPLITTING if batch.query.device.type == "cpu" else None
    out = paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables,
                                 batch.scale, num_splits=num_splits, config=config, k_scale=batch.k_scale,
                                 v_scale=batch.v_scale, window=window)
    assert rel_error(out, reference(batch, window)) < tol


@pytest.mark.parametrize("window", [0, 7])
def test_mixed_plan_matches_reference(window):
    """Decode rows (split) and prompt chunks in one planned launch; the plan of one window is not another's."""
    batch = make_paged_batch([1, 1, 9, 14], [50, 23, 30, 14], 8, 4, 2, 16, torch.float32, seed=3)
    out = torch.full_like(batch.query, float("nan"))
    plan = plan_paged_attention(batch.query, batch.k_cache, batch.v_cache, out, batch.cu_seqlens_q, batch.seq_lens,
                                batch.block_tables, 2, 14, decode_config=SPLITTING, window=window)
    assert plan.partial_shape[2] > 1  # the decode rows split
    plan.launch(batch.query, batch.k_cache, batch.v_cache, out, batch.scale)
    assert rel_error(out, reference(batch, window)) < 1e-5
    full = plan_paged_attention(batch.query, batch.k_cache, batch.v_cache, out, batch.cu_seqlens_q, batch.seq_lens,
                                batch.block_tables, 2, 14, decode_config=SPLITTING)
    assert (plan.key == full.key) == (window == 0)
