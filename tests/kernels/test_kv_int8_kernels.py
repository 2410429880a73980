"""The Triton kernels over an int8 KV cache (kv_cache_dtype=int8): the store writes the reference's rows, and
the decode, prefill and mixed kernels, their query rotated before and output rotated back, give the torch
reference's attention (kernels/reference.py `paged_attention_int8_reference`)."""
import pytest
import torch

from spmd_engine.kernels.decode_attention import paged_decode_attention
from spmd_engine.kernels.kv_int8 import rotate_rows, store_kv_int8
from spmd_engine.kernels.mixed_attention import plan_paged_attention
from spmd_engine.kernels.prefill_attention import paged_prefill_attention
from spmd_engine.kernels.reference import (hadamard_reference, paged_attention_int8_reference,
                                           quantize_kv_int8_reference, store_kv_int8_reference)
from tests.kernels.paged_batch import DEVICE, gpu_case, make_paged_batch, rel_error

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # triton interpreter noise


def int8_batch(query_lens, seq_lens, block_size, hq, hkv, head_dim, dtype, seed=0):
    """A paged batch whose caches hold the reference's int8 rows of its random K/V."""
    batch = make_paged_batch(query_lens, seq_lens, block_size, hq, hkv, head_dim, dtype, seed=seed)
    n = batch.k_cache.shape[0]
    for name in ("k_cache", "v_cache"):
        values = getattr(batch, name).float().reshape(-1, hkv, head_dim)
        setattr(batch, name, quantize_kv_int8_reference(values).reshape(n, block_size, hkv, head_dim + 4))
    return batch


def reference(batch, window=0):
    return paged_attention_int8_reference(batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q,
                                          batch.seq_lens, batch.block_tables, batch.scale, window=window)


def rotated(attend, batch):
    """`attend(q H)` H: the kernels read the cache in the rotated basis."""
    out = attend(rotate_rows(batch.query), torch.empty(batch.query.shape, dtype=torch.float32,
                                                                    device=DEVICE))
    return rotate_rows(out, dtype=batch.query.dtype)


def test_store_writes_the_reference_rows_and_skips_padding():
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(13, 2, 16, generator=gen) * 3, torch.randn(13, 2, 16, generator=gen)
    k[4] = 0.0  # an all-zero row: scale 1e-30, values 0
    slots = torch.randperm(40, generator=gen)[:13]
    slots[2] = -1  # padding: nothing stored
    ours = [torch.full((10, 4, 2, 20), 7, dtype=torch.int8, device=DEVICE) for _ in range(2)]
    refs = [torch.full((10, 4, 2, 20), 7, dtype=torch.int8) for _ in range(2)]
    store_kv_int8(k.to(DEVICE), v.to(DEVICE), *ours, slots.to(DEVICE))
    store_kv_int8_reference(k, v, *refs, slots)
    for mine, ref in zip(ours, refs):
        mine = mine.cpu()
        torch.testing.assert_close(mine[..., 16:].contiguous().view(torch.float32),
                                   ref[..., 16:].contiguous().view(torch.float32), rtol=1e-6, atol=0)
        # the rotation's float32 sums run in another order: a value at a rounding tie may move one step
        assert (mine[..., :16].int() - ref[..., :16].int()).abs().max() <= 1
        untouched = torch.ones(40, dtype=torch.bool)
        untouched[slots[slots >= 0]] = False
        assert (mine.view(40, 2, 20)[untouched] == 7).all()


def test_rotation_is_its_own_inverse_and_takes_strided_rows():
    x = torch.randn(5, 3, 32, device=DEVICE)
    torch.testing.assert_close(rotate_rows(rotate_rows(x)), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotate_rows(x), x @ hadamard_reference(32, x.device), atol=1e-6, rtol=1e-6)
    wide = torch.randn(5, 5, 32, device=DEVICE)
    out = torch.zeros(5, 4, 32, device=DEVICE)
    rotate_rows(wide[:, 1:4], out=out[:, :3])
    torch.testing.assert_close(out[:, :3], wide[:, 1:4] @ hadamard_reference(32, x.device), atol=1e-6, rtol=1e-6)
    assert not out[:, 3].any()


# (seq_lens, block_size, Hq, Hkv, head_dim, dtype, num_splits, window, max rel error)
DECODE = [
    pytest.param([1, 16, 17, 40], 16, 4, 4, 32, torch.float32, None, 0, 1e-5, id="bs16-gqa1-fp32"),
    pytest.param([70, 3, 29], 4, 4, 2, 16, torch.float16, 3, 0, 2e-3, id="bs4-gqa2-fp16-split3"),
    pytest.param([33, 9], 8, 8, 2, 16, torch.float32, 2, 5, 1e-5, id="bs8-gqa4-fp32-window5"),
    gpu_case([512 + 97 * i for i in range(64)], 16, 16, 8, 128, torch.bfloat16, None, 0, 1e-2),
]


@pytest.mark.parametrize("seq_lens,block_size,hq,hkv,head_dim,dtype,num_splits,window,tol", DECODE)
def test_decode_matches_reference(seq_lens, block_size, hq, hkv, head_dim, dtype, num_splits, window, tol):
    batch = int8_batch([1] * len(seq_lens), seq_lens, block_size, hq, hkv, head_dim, dtype)
    out = rotated(lambda q, o: paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.seq_lens,
                                                      batch.block_tables, batch.scale, o, num_splits=num_splits,
                                                      window=window), batch)
    assert rel_error(out, reference(batch, window)) < tol


# (query_lens, seq_lens, block_size, Hq, Hkv, head_dim, dtype, window, max rel error)
PREFILL = [
    pytest.param([5, 17], [5, 30], 4, 4, 2, 16, torch.float32, 0, 1e-5, id="bs4-gqa2-fp32-prefix"),
    pytest.param([20, 3], [20, 40], 16, 4, 1, 32, torch.float16, 0, 2e-3, id="bs16-gqa4-fp16"),
    pytest.param([19, 6], [25, 6], 8, 2, 2, 16, torch.float32, 7, 1e-5, id="bs8-gqa1-fp32-window7"),
    gpu_case([1024] * 4, [1024, 1500, 2048, 1100], 16, 16, 8, 128, torch.bfloat16, 0, 1e-2),
]


@pytest.mark.parametrize("query_lens,seq_lens,block_size,hq,hkv,head_dim,dtype,window,tol", PREFILL)
def test_prefill_matches_reference(query_lens, seq_lens, block_size, hq, hkv, head_dim, dtype, window, tol):
    batch = int8_batch(query_lens, seq_lens, block_size, hq, hkv, head_dim, dtype)
    out = rotated(lambda q, o: paged_prefill_attention(q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q,
                                                       batch.seq_lens, batch.block_tables, batch.scale,
                                                       batch.max_query_len, o, window=window), batch)
    assert rel_error(out, reference(batch, window)) < tol


@pytest.mark.parametrize("dtype,window,tol", [(torch.float32, 0, 1e-5), (torch.float16, 6, 2e-3)])
def test_mixed_plan_matches_reference(dtype, window, tol):
    """Two decode rows, then two prompt chunks (one over a cached prefix), in the planned launch."""
    batch = int8_batch([1, 1, 9, 4], [21, 6, 9, 14], 4, 4, 2, 16, dtype, seed=2)

    def attend(q, out):
        plan = plan_paged_attention(q, batch.k_cache, batch.v_cache, out, batch.cu_seqlens_q, batch.seq_lens,
                                    batch.block_tables, 2, 9, window=window)
        return plan.launch(q, batch.k_cache, batch.v_cache, out, batch.scale)

    assert rel_error(rotated(attend, batch), reference(batch, window)) < tol
