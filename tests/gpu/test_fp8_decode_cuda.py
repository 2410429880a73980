"""The CUDA fp8 decode kernel (kernels/decode_attention_fp8_cuda.py) against the torch reference and the
Triton fp8 kernel: GQA groups, block sizes, lengths around tile and block edges, split counts, e4m3 NaN
bytes past every end (an odd end's pair partner included), a float16 model, and CUDA-graph replay."""
from __future__ import annotations

import math

import pytest
import torch

from spmd_engine.kernels.decode_attention import paged_decode_attention
from spmd_engine.kernels.kv_quant import FP8_DTYPE, v_pairs
from spmd_engine.kernels.reference import paged_attention_reference
from tests.gpu.engine_setup import GPU

pytestmark = GPU
D = 128
LENGTHS = [1, 2, 3, 63, 64, 65, 127, 128, 129, 777, 1500, 2049]


def _fp8_cuda():
    from spmd_engine.kernels import cuda_rtc, decode_attention_fp8_cuda

    try:
        cuda_rtc._nvrtc()
    except cuda_rtc.CudaRtcUnavailable as err:
        pytest.skip(str(err))
    return decode_attention_fp8_cuda


def _inputs(lengths, hq, hkv, block_size, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [math.ceil(n / block_size) for n in lengths]
    total = sum(blocks) + 2
    k = (torch.randn(total, block_size, hkv, D, device="cuda", generator=gen) * 2).to(FP8_DTYPE)
    v = (torch.randn(total, block_size, hkv, D, device="cuda", generator=gen) * 2).to(FP8_DTYPE)
    order = torch.randperm(total, device="cuda", generator=gen).to(torch.int32)
    tables = torch.zeros(len(lengths), max(blocks) + 1, dtype=torch.int32, device="cuda")
    k_bytes, v_bytes = k.view(torch.uint8), v_pairs(v).view(torch.uint8)
    used = 0
    for b, n in enumerate(lengths):
        tables[b, :blocks[b]] = order[used:used + blocks[b]]
        used += blocks[b]
        for pos in range(n, blocks[b] * block_size):  # e4m3 NaN past the end inside the last block
            blk, slot = int(tables[b, pos // block_size]), pos % block_size
            k_bytes[blk, slot] = 0x7F
            v_bytes[blk, slot // 2, :, :, slot % 2] = 0x7F
    for blk in order[used:].tolist():  # and in the blocks nobody owns
        k_bytes[blk] = 0x7F
        v_bytes[blk] = 0x7F
    query = torch.randn(len(lengths), hq, D, device="cuda", dtype=dtype, generator=gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    k_scale = torch.exp2(-(torch.arange(hkv, device="cuda", dtype=torch.float32) % 4)) / 8
    v_scale = torch.exp2(-(torch.arange(hkv, device="cuda", dtype=torch.float32) % 3))
    return query, k, v, seq_lens, tables, k_scale, v_scale


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("hq,hkv", [(16, 8), (32, 8), (8, 8), (14, 2)])
@pytest.mark.parametrize("block_size", [4, 16, 32, 128])
def test_fp8_cuda_decode_matches_the_reference(hq, hkv, block_size):
    fp8_cuda = _fp8_cuda()
    query, k, v, seq_lens, tables, k_scale, v_scale = _inputs(LENGTHS, hq, hkv, block_size)
    assert fp8_cuda.supports(query, k, v)
    cu = torch.arange(len(LENGTHS) + 1, dtype=torch.int32, device="cuda")
    ref = paged_attention_reference(query, k, v, cu, seq_lens, tables, 0.088, k_scale=k_scale, v_scale=v_scale)
    triton_err = _rel(paged_decode_attention(query, k, v, seq_lens, tables, 0.088, k_scale=k_scale,
                                             v_scale=v_scale), ref)
    for splits in (None, 1, 3, 8):
        out = fp8_cuda.paged_decode_attention_fp8(query, k, v, seq_lens, tables, 0.088, k_scale=k_scale,
                                                  v_scale=v_scale, num_splits=splits)
        assert torch.isfinite(out).all(), splits
        # float16 dots with float32 sums, as the Triton fp8 path: the same order of error
        assert _rel(out, ref) < max(2 * triton_err, 2e-3), (splits, _rel(out, ref), triton_err)


def test_fp8_cuda_decode_float16_model_and_graph_replay():
    fp8_cuda = _fp8_cuda()
    query, k, v, seq_lens, tables, k_scale, v_scale = _inputs([5, 300, 1025, 64], 16, 8, 16, dtype=torch.float16)
    cu = torch.arange(5, dtype=torch.int32, device="cuda")
    ref = paged_attention_reference(query, k, v, cu, seq_lens, tables, 0.088, k_scale=k_scale, v_scale=v_scale)
    eager = fp8_cuda.paged_decode_attention_fp8(query, k, v, seq_lens, tables, 0.088, k_scale=k_scale,
                                                v_scale=v_scale)
    assert _rel(eager, ref) < 2e-3
    out = torch.empty_like(query)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_cuda.paged_decode_attention_fp8(query, k, v, seq_lens, tables, 0.088, out, k_scale=k_scale,
                                            v_scale=v_scale)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_fp8_cuda_decode_refuses_what_it_does_not_take():
    fp8_cuda = _fp8_cuda()
    query, k, v, *_ = _inputs([10], 16, 8, 16)
    assert not fp8_cuda.supports(query[..., :64], k[..., :64], v[..., :64])  # head_dim 64
    assert not fp8_cuda.supports(query.float(), k, v)  # a float32 model
    q16 = torch.randn(1, 32, D, device="cuda", dtype=torch.bfloat16)
    assert not fp8_cuda.supports(q16, k[:, :, :2].contiguous(), v[:, :, :2].contiguous())  # 16 query heads a KV head


@pytest.mark.parametrize("hq,hkv", [(16, 8), (14, 2)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("norm", [True, False])
def test_fp8_cuda_decode_prepares_its_own_q_and_new_kv_as_the_store_kernel_does(hq, hkv, block_size, norm):
    """With a `DecodePrologue` the fp8 kernel norms and rotates q and makes, quantizes and stores the new K/V
    itself: the cache as qk_norm_rope_store leaves it (V bytes equal; a K byte at most one e4m3 step away, the
    norm's sum running in another order) and the output of the two launches, for every split count. The cache
    holds e4m3 NaN at every new row beforehand (an even and an odd last position among the lengths)."""
    from spmd_engine.kernels.qk_norm_rope_store import qk_norm_rope_store
    from tests.gpu.test_decode_cuda import _prologue_case

    fp8_cuda = _fp8_cuda()
    _, k_cache, v_cache, seq_lens, tables, k_scale, v_scale = _inputs(LENGTHS, hq, hkv, block_size)
    query, k_cache, v_cache, seq_lens, tables, p = _prologue_case(LENGTHS, hq, hkv, block_size, norm,
                                                                  caches=(k_cache, v_cache, seq_lens, tables))
    k_bytes, v_bytes = k_cache.view(torch.uint8), v_pairs(v_cache).view(torch.uint8)
    for b, n in enumerate(LENGTHS):  # NaN where each new row goes
        blk, slot = int(tables[b, (n - 1) // block_size]), (n - 1) % block_size
        k_bytes[blk, slot] = 0x7F
        v_bytes[blk, slot // 2, :, :, slot % 2] = 0x7F
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    for splits in (None, 1, 3, 8):
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        rotated = qk_norm_rope_store(query, p.k, p.v, p.cos, p.sin, k_ref, v_ref, p.slot_mapping, p.q_weight,
                                     p.k_weight, p.eps, k_scale, v_scale)
        expected = fp8_cuda.paged_decode_attention_fp8(rotated, k_ref, v_ref, seq_lens, tables, 0.088,
                                                       num_splits=splits, **scales)
        k_got, v_got = k_cache.clone(), v_cache.clone()
        out = fp8_cuda.paged_decode_attention_fp8(query, k_got, v_got, seq_lens, tables, 0.088, num_splits=splits,
                                                  prologue=p, **scales)
        assert torch.isfinite(out).all(), splits
        assert torch.equal(v_got.view(torch.uint8), v_ref.view(torch.uint8)), splits
        k_step = (k_got.view(torch.uint8).int() - k_ref.view(torch.uint8).int()).abs()
        assert int(k_step.max()) <= 1 and int((k_step > 0).sum()) <= k_step.numel() // 1000, splits
        assert _rel(out, expected) < 2e-3, (splits, _rel(out, expected))
