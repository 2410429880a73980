import pytest
import torch

from spmd_engine.kernels.attention_support import supports_shape as supports
from spmd_engine.kernels.prefill_attention import default_prefill_config, paged_prefill_attention
from spmd_engine.kernels.reference import paged_attention_reference
from tests.kernels.paged_batch import DEVICE, gpu_case, make_paged_batch, rel_error

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # triton interpreter noise

# (query_lens, seq_lens, block_size, Hq, Hkv, head_dim, dtype, max rel error)
CASES = [
    # cached prefixes crossing block boundaries, a fresh prompt and a decode-like row; GQA 1
    pytest.param([5, 17, 1], [5, 40, 33], 16, 4, 4, 32, torch.float32, 1e-5, id="bs16-gqa1-fp32"),
    pytest.param([20, 3], [70, 3], 64, 4, 2, 16, torch.float16, 2e-3, id="bs64-gqa2-fp16"),
    # a sequence with no new tokens in the batch, a context crossing a 256 block
    pytest.param([9, 0, 2], [300, 4, 2], 256, 4, 1, 16, torch.float32, 1e-5, id="bs256-gqa4-fp32"),
    # block smaller than the key tile: per-row block-id gather
    pytest.param([6, 11], [6, 30], 4, 8, 1, 16, torch.float16, 2e-3, id="bs4-gqa8-fp16"),
    gpu_case([1024] * 16, [1024] * 16, 16, 16, 8, 128, torch.bfloat16, 1e-2),
    gpu_case(
        [64 * (i % 7) + i for i in range(1, 65)], [4096 - 57 * i for i in range(64)],
        256, 32, 4, 128, torch.bfloat16, 1e-2,
    ),
    gpu_case([300, 7, 1, 512], [300, 2000, 3000, 513], 16, 8, 1, 64, torch.float16, 2e-3),
    gpu_case([200, 33], [1000, 33], 32, 8, 2, 256, torch.bfloat16, 1e-2),
]


@pytest.mark.parametrize("query_lens,seq_lens,block_size,hq,hkv,head_dim,dtype,tol", CASES)
def test_matches_reference(query_lens, seq_lens, block_size, hq, hkv, head_dim, dtype, tol):
    batch = make_paged_batch(query_lens, seq_lens, block_size, hq, hkv, head_dim, dtype)
    out = torch.full_like(batch.query, float("nan"))
    result = paged_prefill_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens,
        batch.block_tables, batch.scale, batch.max_query_len, out=out,
    )
    assert result is out
    ref = paged_attention_reference(
        batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens,
        batch.block_tables, batch.scale,
    )
    assert rel_error(out, ref) < tol


def test_cuda_tile_config_masks_correctly():
    """The H200 tiles (query tile larger than the KV block, several diagonal tiles) on a small batch."""
    batch = make_paged_batch([130, 1, 70], [300, 1, 90], 16, 2, 1, 16, torch.float32, seed=2)
    config = default_prefill_config(128, torch.device("cuda"))
    out = paged_prefill_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens,
        batch.block_tables, batch.scale, batch.max_query_len, config=config,
    )
    ref = paged_attention_reference(
        batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens,
        batch.block_tables, batch.scale,
    )
    assert rel_error(out, ref) < 1e-5


def test_strided_query_view_and_fresh_output():
    batch = make_paged_batch([3, 8], [3, 20], 16, 2, 2, 16, torch.float32, seed=1)
    packed = torch.cat([batch.query, torch.randn_like(batch.query)], dim=1)  # like a fused qkv
    query = packed[:, :2]
    out = paged_prefill_attention(
        query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens,
        batch.block_tables, batch.scale, batch.max_query_len,
    )
    ref = paged_attention_reference(
        batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens,
        batch.block_tables, batch.scale,
    )
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    assert rel_error(out, ref) < 1e-5


def test_supports_and_clear_errors():
    assert supports(16, 128) and supports(256, 64) and supports(1, 16)
    assert not supports(24, 128) and not supports(16, 80)
    q = torch.zeros(2, 2, 24, device=DEVICE)
    cache = torch.zeros(4, 16, 2, 24, device=DEVICE)
    cu = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        paged_prefill_attention(q, cache, cache, cu, lens, table, 1.0, 2)
    q = torch.zeros(2, 3, 16, device=DEVICE)
    cache = torch.zeros(4, 16, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_prefill_attention(q, cache, cache, cu, lens, table, 1.0, 2)


# (query_lens, seq_lens, block_size, Hq, Hkv, head_dim, dtype, max rel error) with a float8_e4m3fn cache
FP8_CASES = [
    pytest.param([5, 17, 1], [5, 40, 33], 16, 4, 4, 32, torch.float32, 1e-5, id="bs16-gqa1-fp32"),
    pytest.param([20, 3], [70, 3], 64, 4, 2, 16, torch.float16, 2e-3, id="bs64-gqa2-fp16"),
    pytest.param([6, 11], [6, 30], 4, 8, 2, 16, torch.float32, 1e-5, id="bs4-gqa4-fp32"),
    gpu_case([1024] * 16, [1024] * 16, 16, 16, 8, 128, torch.bfloat16, 1e-2),
    gpu_case([300, 7, 1, 512], [300, 2000, 3000, 513], 16, 8, 1, 64, torch.bfloat16, 1e-2),
    gpu_case([200, 33], [1000, 33], 32, 8, 2, 256, torch.bfloat16, 1e-2),
]


@pytest.mark.parametrize("query_lens,seq_lens,block_size,hq,hkv,head_dim,dtype,tol", FP8_CASES)
def test_fp8_cache_matches_reference(query_lens, seq_lens, block_size, hq, hkv, head_dim, dtype, tol):
    """fp8 K/V upcast on load with per-KV-head scales, against the reference's dequantize-then-attend."""
    batch = make_paged_batch(query_lens, seq_lens, block_size, hq, hkv, head_dim, dtype, kv_fp8=True)
    out = paged_prefill_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables,
        batch.scale, batch.max_query_len, k_scale=batch.k_scale, v_scale=batch.v_scale,
    )
    ref = batch.reference()
    assert rel_error(out, ref) < tol
    ones = torch.ones_like(batch.k_scale)  # the scales matter: ignoring them is far off
    unscaled = paged_prefill_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables,
        batch.scale, batch.max_query_len, k_scale=ones, v_scale=ones,
    )
    assert rel_error(unscaled, ref) > 0.1


def test_scales_on_a_plain_cache_are_refused():
    batch = make_paged_batch([3], [3], 16, 2, 2, 16, torch.float32)
    scale = torch.ones(2, device=DEVICE)
    with pytest.raises(ValueError, match="only for a float8_e4m3fn cache"):
        paged_prefill_attention(batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens,
                                batch.block_tables, batch.scale, batch.max_query_len, k_scale=scale, v_scale=scale)
