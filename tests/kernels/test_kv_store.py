import pytest
import torch

from spmd_engine.kernels.kv_store import store_kv
from spmd_engine.kernels.reference import store_kv_reference
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


def _edge_values() -> torch.Tensor:
    """Every finite e4m3fn value, the midpoints between neighbours (ties to even) and just either side
    of them, subnormals, +-0 and values past the +-448 saturation point."""
    from spmd_engine.kernels.kv_quant import FP8_DTYPE

    exact = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    exact = exact[exact.isfinite()].unique().sort().values
    mids = (exact[1:] + exact[:-1]) / 2
    return torch.cat([exact, mids, mids * (1 + 1e-6), mids * (1 - 1e-6),
                      torch.tensor([-0.0, 0.0, 449.0, -460.0, 1e4, -1e30, 1e-30])])


# (num_tokens, block_size, Hkv, head_dim, input dtype, scales)
FP8_CASES = [
    pytest.param(None, 16, 2, 16, torch.float32, (1.0, 0.25), id="edges-fp32-pow2"),
    pytest.param(None, 4, 2, 16, torch.float32, (0.3, 3.0), id="edges-fp32-non-pow2"),
    pytest.param(37, 8, 4, 32, torch.float16, (2.0**-5, 1.0, 4.0, 2.0**-9), id="randn-fp16"),
    gpu_case(4096, 16, 8, 128, torch.bfloat16, tuple(2.0 ** -i for i in range(8))),
]


@pytest.mark.parametrize("tokens,block_size,heads,head_dim,dtype,scales", FP8_CASES)
def test_fp8_store_writes_the_reference_bytes(tokens, block_size, heads, head_dim, dtype, scales):
    """Quantized in the kernel (x / scale, saturated, round to nearest even): byte for byte the reference."""
    from spmd_engine.kernels.kv_quant import FP8_DTYPE

    gen = torch.Generator().manual_seed(1)
    if tokens is None:  # every edge value, in every head (one scale per head)
        values = _edge_values()
        values = values[torch.randperm(values.numel(), generator=gen)]
        per_token = heads * head_dim
        tokens = -(-values.numel() // per_token)
        values = torch.cat([values, torch.zeros(tokens * per_token - values.numel())])
        key = values.view(tokens, heads, head_dim)
    else:
        key = torch.randn(tokens, heads, head_dim, generator=gen) * 30
    value = key.flip(0) * 0.01
    key, value = key.to(dtype).to(DEVICE), value.to(dtype).to(DEVICE)
    k_scale = torch.tensor(scales, dtype=torch.float32, device=DEVICE)
    v_scale = k_scale.flip(0).contiguous()
    blocks = -(-tokens // block_size) + 1
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[torch.rand(tokens, generator=gen) < 0.1] = -1
    slots = slots.to(DEVICE)
    k_cache = torch.zeros(blocks, block_size, heads, head_dim, dtype=FP8_DTYPE, device=DEVICE)
    v_cache, k_ref, v_ref = k_cache.clone(), k_cache.clone(), k_cache.clone()

    store_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    store_kv_reference(key, value, k_ref, v_ref, slots, k_scale, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    assert k_cache.float().isfinite().all()  # saturated, never NaN
    written = k_ref[slots[slots >= 0] // block_size, slots[slots >= 0] % block_size].float()
    assert written.abs().max() == 448.0  # every case has values past the range: saturated, not NaN


def test_fp8_store_needs_scales():
    from spmd_engine.kernels.kv_quant import FP8_DTYPE

    cache = torch.zeros(2, 16, 2, 16, dtype=FP8_DTYPE, device=DEVICE)
    key = torch.zeros(3, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="needs k_scale"):
        store_kv(key, key, cache, cache.clone(), torch.zeros(3, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("fused", [False, True], ids=["store_kv", "qk_norm_rope_store"])
def test_fp8_v_goes_in_pairs_of_positions_k_in_place(fused):
    """kv_quant.FP8_V_LAYOUT, as both store kernels write it: V at (block, position p, head, dim) sits at
    pair p // 2, slot p % 2 of [block, bs / 2, Hkv, D, 2]; K stays [block, bs, Hkv, D]. Values that are
    exact in e4m3 (token + 1 times a power of two, signed by head) and unit scales."""
    from spmd_engine.kernels.kv_quant import FP8_DTYPE, read_v_blocks, v_pairs
    from spmd_engine.kernels.qk_norm_rope_store import qk_norm_rope_store

    block_size, heads, head_dim, tokens = 8, 2, 16, 11
    token = torch.arange(tokens, dtype=torch.float32)[:, None, None]
    head = torch.arange(heads, dtype=torch.float32)[None, :, None]
    dim = torch.arange(head_dim, dtype=torch.float32)[None, None, :]
    value = ((token + 1) * 2.0 ** -(dim % 8) * (1 - 2 * head)).to(torch.float16).to(DEVICE)  # e4m3-exact
    key = -value
    slots = torch.tensor([8, 9, 10, 11, 12, 13, 14, 15, 3, 0, 5], device=DEVICE)  # block 1 whole, block 0 odd
    scales = torch.ones(heads, dtype=torch.float32, device=DEVICE)
    k_cache = torch.zeros(2, block_size, heads, head_dim, dtype=FP8_DTYPE, device=DEVICE)
    v_cache = k_cache.clone()
    if fused:  # rotary by angle 0 (cos 1, sin 0) and no norm: k goes to the cache as it is
        q = torch.zeros(tokens, heads, head_dim, dtype=torch.float16, device=DEVICE)
        cos = torch.ones(tokens, head_dim // 2, dtype=torch.float16, device=DEVICE)
        qk_norm_rope_store(q, key, value, cos, torch.zeros_like(cos), k_cache, v_cache, slots, None, None, 0.0,
                           scales, scales)
    else:
        store_kv(key, value, k_cache, v_cache, slots, scales, scales)
    for t, slot in enumerate(slots.tolist()):
        block, pos = divmod(slot, block_size)
        assert torch.equal(k_cache[block, pos].float(), key[t].float()), t
        assert torch.equal(v_pairs(v_cache)[block, pos // 2, :, :, pos % 2].float(), value[t].float()), t
        assert torch.equal(read_v_blocks(v_cache, torch.tensor([block], device=DEVICE))[0, pos].float(),
                           value[t].float()), t


def test_fp8_cache_needs_an_even_block_size_in_one_line():
    from spmd_engine.kernels.kv_quant import FP8_DTYPE

    k_cache = torch.zeros(4, 1, 2, 16, dtype=FP8_DTYPE, device=DEVICE)
    scales = torch.ones(2, dtype=torch.float32, device=DEVICE)
    key = torch.zeros(1, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"^store_kv: a float8_e4m3fn KV cache needs an even block_size"):
        store_kv(key, key, k_cache, k_cache.clone(), torch.zeros(1, dtype=torch.int64, device=DEVICE), scales, scales)
