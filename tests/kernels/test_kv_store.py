import pytest
import torch

from kernels.kv_store import store_kv
from kernels.reference import store_kv_reference
from tests.kernels.paged_batch import DEVICE, gpu_case

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # triton interpreter noise

# (num_tokens, num_blocks, block_size, Hkv, head_dim, input dtype, cache dtype, slot dtype)
CASES = [
    pytest.param(7, 4, 16, 2, 32, torch.float32, torch.float32, torch.int64, id="bs16-fp32-int64"),
    pytest.param(9, 6, 4, 3, 16, torch.float16, torch.float16, torch.int32, id="bs4-fp16-int32"),
    pytest.param(5, 2, 256, 1, 16, torch.float32, torch.float16, torch.int64, id="bs256-cast"),
    gpu_case(4096, 512, 16, 8, 128, torch.bfloat16, torch.bfloat16, torch.int64),
    gpu_case(3000, 32, 256, 8, 128, torch.bfloat16, torch.bfloat16, torch.int32),
]


@pytest.mark.parametrize("tokens,blocks,block_size,heads,head_dim,dtype,cache_dtype,slot_dtype", CASES)
def test_matches_reference(tokens, blocks, block_size, heads, head_dim, dtype, cache_dtype, slot_dtype):
    gen = torch.Generator().manual_seed(tokens)
    # keys/values as strided views of a fused projection, like the model produces them
    fused = torch.randn(tokens, 2 * heads + 1, head_dim, generator=gen).to(dtype).to(DEVICE)
    key, value = fused[:, :heads], fused[:, heads : 2 * heads]
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[torch.rand(tokens, generator=gen) < 0.3] = -1  # padded tokens
    slots = slots.to(slot_dtype).to(DEVICE)
    k_cache = torch.randn(blocks, block_size, heads, head_dim, generator=gen).to(cache_dtype).to(DEVICE)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(cache_dtype).to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    store_kv(key, value, k_cache, v_cache, slots)
    store_kv_reference(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_all_padding_and_empty_batch_write_nothing():
    k_cache = torch.randn(2, 16, 2, 16, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    before = (k_cache.clone(), v_cache.clone())
    key = torch.randn(3, 2, 16, device=DEVICE)
    store_kv(key, key, k_cache, v_cache, torch.full((3,), -1, device=DEVICE))
    empty = key[:0]
    store_kv(empty, empty, k_cache, v_cache, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_shape_mismatch_is_a_clear_error():
    cache = torch.zeros(2, 16, 2, 16, device=DEVICE)
    key = torch.zeros(3, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="heads/head_dim"):
        store_kv(key, key, cache, cache, torch.zeros(3, dtype=torch.int64, device=DEVICE))
