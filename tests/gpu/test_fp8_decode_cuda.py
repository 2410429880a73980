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
