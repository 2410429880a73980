"""The int8 KV cache's torch reference (kv_cache_dtype=int8): Hadamard-rotated rows, a float32 scale per (token,
KV head) stored at the row's end, attention over it close to the unquantized cache's, blocks copied with their
scales."""
import pytest
import torch

from spmd_engine.executor.kv_cache import KVCacheSpec, allocate_kv_cache, copy_kv_blocks
from spmd_engine.kernels.reference import (dequantize_kv_int8_reference, hadamard_reference,
                                           paged_attention_int8_reference, paged_attention_reference,
                                           quantize_kv_int8_reference, store_kv_int8_reference, store_kv_reference)

D, HKV, HQ, BS = 16, 2, 4, 4


def test_hadamard_is_orthonormal_and_symmetric():
    h = hadamard_reference(16)
    torch.testing.assert_close(h @ h, torch.eye(16), atol=1e-6, rtol=0)
    assert torch.equal(h, h.t())
    with pytest.raises(ValueError, match="power-of-two head_dim, got 24"):
        hadamard_reference(24)


def test_rows_hold_the_rotated_values_to_half_a_step_and_their_scale():
    x = torch.randn(7, HKV, D) * torch.logspace(-2, 1, D)  # an outlier-heavy head
    rows = quantize_kv_int8_reference(x)
    assert rows.dtype == torch.int8 and rows.shape == (7, HKV, D + 4)
    rotated = x @ hadamard_reference(D)
    scale = rotated.abs().amax(-1, keepdim=True) / 127
    assert torch.equal(rows[..., D:].contiguous().view(torch.float32), scale)
    err = (dequantize_kv_int8_reference(rows) - rotated).abs()
    assert (err <= scale / 2 * (1 + 1e-5)).all()


def paged_case(seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = [9, 3]  # tokens already cached + new, per sequence
    total = sum(lens)
    k, v = torch.randn(total, HKV, D, generator=gen), torch.randn(total, HKV, D, generator=gen)
    q = torch.randn(total, HQ, D, generator=gen)
    tables = torch.tensor([[5, 2, 7], [3, 0, 0]], dtype=torch.int32)
    slots = torch.tensor([int(tables[b, p // BS]) * BS + p % BS for b, n in enumerate(lens) for p in range(n)])
    slots[2] = -1  # a padding row: not stored
    cu = torch.tensor([0, 9, 12], dtype=torch.int32)
    return q, k, v, slots, tables, cu, torch.tensor(lens, dtype=torch.int32)


def test_attention_over_the_int8_cache_is_close_to_the_float_cache():
    q, k, v, slots, tables, cu, lens = paged_case()
    k8 = torch.zeros(8, BS, HKV, D + 4, dtype=torch.int8)
    v8 = torch.zeros_like(k8)
    kf, vf = torch.zeros(8, BS, HKV, D), torch.zeros(8, BS, HKV, D)
    store_kv_int8_reference(k, v, k8, v8, slots)
    store_kv_reference(k, v, kf, vf, slots)
    assert not k8[5, 2].any()  # slot -1 left untouched
    out = paged_attention_int8_reference(q, k8, v8, cu, lens, tables, D**-0.5)
    ref = paged_attention_reference(q, kf, vf, cu, lens, tables, D**-0.5)
    assert out.dtype == q.dtype
    assert (out - ref).abs().max() < 0.03 * ref.abs().max()
    # the same values dequantized by hand into a float cache: the same attention (exact up to float32 order)
    deq_k = torch.zeros_like(kf)
    deq_v = torch.zeros_like(vf)
    h = hadamard_reference(D)
    deq_k[:] = dequantize_kv_int8_reference(k8) @ h
    deq_v[:] = dequantize_kv_int8_reference(v8) @ h
    torch.testing.assert_close(out, paged_attention_reference(q, deq_k, deq_v, cu, lens, tables, D**-0.5),
                               atol=1e-5, rtol=1e-5)


def test_the_spec_counts_scales_and_block_copies_carry_them():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=HKV, head_dim=D, block_size=BS, dtype=torch.int8)
    assert spec.row_width == D + 4 and spec.bytes_per_block == 2 * 2 * BS * HKV * (D + 4)
    for head_dim in (64, 128):  # SmolLM2, Qwen3: 1.88x and 1.94x the tokens of a bf16 cache
        bf16 = KVCacheSpec(1, 1, head_dim, BS, torch.bfloat16)
        assert bf16.bytes_per_block / KVCacheSpec(1, 1, head_dim, BS, torch.int8).bytes_per_block > 1.8
    caches = allocate_kv_cache(spec, 4, torch.device("cpu"))
    k, v = caches[1]
    store_kv_int8_reference(torch.randn(BS, HKV, D), torch.randn(BS, HKV, D), k, v, torch.arange(BS))
    copy_kv_blocks(caches, torch.tensor([[0, 3]]))
    assert torch.equal(k[3], k[0]) and torch.equal(v[3], v[0])
