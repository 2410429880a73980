"""Decode attention that prepares its own q/k (kernels/decode_rotary_attention.py) against the two launches it
replaces, `qk_norm_rope_store` then `paged_decode_attention`: the output and both caches bit for bit (fp8
bytes included), with norms (Qwen3) and without (Llama), GQA groups of 1 to 4, several splits (the new token's
K/V stored by the split holding its position, every split rotating its q), padding rows (slot -1, seq_len 0).
Under TRITON_INTERPRET on CPU at small shapes; the gpu_case entries run Qwen3-0.6B's shape on CUDA."""
from __future__ import annotations

import pytest
import torch

from spmd_engine.kernels.decode_attention import DecodeConfig, default_decode_config, paged_decode_attention
from spmd_engine.kernels.decode_rotary_attention import can_rotate_in_decode, prologue_rows, rotary_decode_attention
from spmd_engine.kernels.qk_norm_rope_store import qk_norm_rope_store
from tests.kernels.paged_batch import DEVICE, gpu_case, make_paged_batch, rel_error
from tests.kernels.test_qk_norm_rope_store import qkv_views

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # triton interpreter noise
EPS = 1e-6


def decode_layer(seq_lens, block_size, hq, hkv, head_dim, dtype, fp8, norms, pad_rows, seed):
    """A decode step's layer: cached context, q/k/v as strided views of one qkv row per sequence, the new
    token's slot at position seq_len - 1 of its table; `pad_rows` trailing rows as a graph pads them."""
    lens = list(seq_lens) + [0] * pad_rows
    batch = make_paged_batch([1] * len(lens), [max(n, 1) for n in lens], block_size, hq, hkv, head_dim, dtype,
                             seed=seed, kv_fp8=fp8)
    batch.seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(seed + 1)
    q, k, v, cos, sin = qkv_views(len(lens), hq, hkv, head_dim, dtype, gen)
    tables = batch.block_tables.cpu()
    slots = [int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size if n else -1
             for b, n in enumerate(lens)]
    weights = {}
    if norms:
        weights = {"q_weight": (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype).to(DEVICE),
                   "k_weight": (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype).to(DEVICE), "eps": EPS}
    return batch, q, k, v, cos, sin, torch.tensor(slots, dtype=torch.int64, device=DEVICE), weights


def two_launches(batch, q, k, v, cos, sin, slots, weights, config, num_splits):
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    scales = {"k_scale": batch.k_scale, "v_scale": batch.v_scale}
    q_rot = qk_norm_rope_store(q, k, v, cos, sin, k_cache, v_cache, slots, **weights, **scales)
    out = paged_decode_attention(q_rot, k_cache, v_cache, batch.seq_lens, batch.block_tables, batch.scale,
                                 config=config, num_splits=num_splits, **scales)
    return out, k_cache, v_cache


def one_launch(batch, q, k, v, cos, sin, slots, weights, config, num_splits):
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    out = rotary_decode_attention(q, k, v, cos, sin, k_cache, v_cache, slots, batch.seq_lens, batch.block_tables,
                                  batch.scale, config=config, num_splits=num_splits, k_scale=batch.k_scale,
                                  v_scale=batch.v_scale, **weights)
    return out, k_cache, v_cache


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


CPU_TILE = DecodeConfig(block_n=16, num_warps=1, num_stages=1, programs_per_sm=1)


# (seq_lens, block_size, Hq, Hkv, head_dim, dtype, fp8 cache, norms, padding rows, splits)
CASES = [
    pytest.param([5, 17, 33, 1], 16, 4, 2, 16, torch.float32, False, True, 1, 1, id="qwen-gqa2-fp32"),
    pytest.param([40, 3, 64], 8, 4, 1, 32, torch.float16, False, False, 0, 3, id="llama-gqa4-splits"),
    pytest.param([70, 16, 9], 16, 2, 2, 16, torch.bfloat16, True, True, 2, 2, id="qwen-mha-fp8-splits"),
    pytest.param([31, 2], 32, 4, 2, 16, torch.float16, True, False, 0, 1, id="llama-fp8"),
    pytest.param([70, 9], 16, 4, 2, 128, torch.float16, True, True, 1, 2, id="qwen-fp8-d128-splits"),
    gpu_case([200 + 37 * i for i in range(129)], 16, 16, 8, 128, torch.bfloat16, False, True, 15, None),
    gpu_case([200 + 37 * i for i in range(129)], 16, 16, 8, 128, torch.bfloat16, True, True, 15, None),
    gpu_case([650, 4000], 16, 16, 8, 128, torch.bfloat16, False, True, 2, None),  # several splits
    gpu_case([100, 2000, 33], 16, 32, 8, 128, torch.float16, False, False, 0, None),  # Llama-like, group 4
]


@pytest.mark.parametrize("seq_lens,block_size,hq,hkv,head_dim,dtype,fp8,norms,pad,splits", CASES)
def test_one_launch_is_bitwise_qk_norm_rope_store_then_decode(seq_lens, block_size, hq, hkv, head_dim, dtype, fp8,
                                                              norms, pad, splits):
    if dtype == torch.float32 and DEVICE.type == "cuda":
        pytest.skip("a float32 model on CUDA keeps the separate kernels (qk_norm_rope_store.can_fuse)")
    layer = decode_layer(seq_lens, block_size, hq, hkv, head_dim, dtype, fp8, norms, pad, seed=len(seq_lens))
    config = CPU_TILE if DEVICE.type == "cpu" else None
    expected = two_launches(*layer, config, splits)
    got = one_launch(*layer, config, splits)
    for name, a, b in zip(("out", "k_cache", "v_cache"), got, expected):
        assert same_bits(a, b), name
    batch = layer[0]
    assert not same_bits(got[1], batch.k_cache), "the new keys must have been stored"
    if pad:
        assert torch.count_nonzero(got[0][-pad:]) == 0  # seq_len 0: no keys, a zero output
    # and attention over the stored cache is what the reference computes
    live = len(seq_lens)
    batch.query, batch.k_cache, batch.v_cache = (qk_norm_rope_store(
        *layer[1:6], got[1].clone(), got[2].clone(), torch.full_like(layer[6], -1), **layer[7],
        k_scale=batch.k_scale, v_scale=batch.v_scale), got[1], got[2])
    batch.seq_lens, batch.block_tables = batch.seq_lens[:live], batch.block_tables[:live]
    batch.query, batch.cu_seqlens_q = batch.query[:live], batch.cu_seqlens_q[: live + 1]
    assert rel_error(got[0][:live], batch.reference()) < (2e-2 if dtype != torch.float32 else 1e-5)


def test_every_layer_of_a_step_through_one_scratch_layout():
    """Two calls in a row (two layers of a step, other caches) keep each other's caches untouched."""
    dtype = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16  # float32 on CUDA: not fused (can_fuse)
    first = decode_layer([9, 30], 16, 4, 2, 16, dtype, False, True, 0, seed=3)
    second = decode_layer([9, 30], 16, 4, 2, 16, dtype, False, True, 0, seed=4)
    config = CPU_TILE if DEVICE.type == "cpu" else None
    a = one_launch(*first, config, 2)
    b = one_launch(*second, config, 2)
    assert all(same_bits(x, y) for x, y in zip(a, two_launches(*first, config, 2)))
    assert all(same_bits(x, y) for x, y in zip(b, two_launches(*second, config, 2)))


def test_prologue_rows_follow_the_decode_tile():
    """One prologue row per warp, as qk_norm_rope_store's tiles; none where that kernel has no such tile."""
    assert prologue_rows(4, 128, 2) == 4 and prologue_rows(1, 128, 1) == 1
    assert prologue_rows(4, 256, 4) == 0  # a float32 row of 256: over one warp's 32 x 16 bytes
    assert prologue_rows(3, 64, 2) == 0
    layer = decode_layer([5], 16, 4, 2, 16, torch.float16, False, True, 0, seed=1)
    _, q, k, v, cos, sin, _, _ = layer
    assert can_rotate_in_decode(q, k, v, cos, sin, True, layer[0].k_cache, CPU_TILE)
    assert not can_rotate_in_decode(q, k, v, cos, sin, True, layer[0].k_cache,
                                    DecodeConfig(block_n=16, num_warps=3, num_stages=1, programs_per_sm=1))
    assert not can_rotate_in_decode(q.contiguous().transpose(1, 2), k, v, cos, sin, True, layer[0].k_cache)
    if DEVICE.type == "cuda":
        assert default_decode_config(128, DEVICE).num_warps == 4


def test_bad_inputs_name_the_field():
    batch, q, k, v, cos, sin, slots, weights = decode_layer([5, 9], 16, 4, 2, 16, torch.float16, False, True, 0, 2)
    with pytest.raises(ValueError, match="q_weight and k_weight"):
        rotary_decode_attention(q, k, v, cos, sin, batch.k_cache, batch.v_cache, slots, batch.seq_lens,
                                batch.block_tables, batch.scale, q_weight=weights["q_weight"])
    with pytest.raises(ValueError, match="cos/sin must be"):
        rotary_decode_attention(q, k, v, cos[:1], sin[:1], batch.k_cache, batch.v_cache, slots, batch.seq_lens,
                                batch.block_tables, batch.scale, config=CPU_TILE, **weights)
    with pytest.raises(ValueError, match="seq_lens"):
        rotary_decode_attention(q, k, v, cos, sin, batch.k_cache, batch.v_cache, slots, batch.seq_lens[:1],
                                batch.block_tables, batch.scale, config=CPU_TILE, **weights)
