"""The fused q/k norm + rotary + KV store against the unfused kernels it replaces (rms_norm_pair,
apply_rotary on q and on k, store_kv): q and both caches bit for bit (fp8 bytes included), for Qwen3-like
(norms) and Llama-like (no norms) layers, GQA, several block sizes, padded slot -1 rows. At real shapes on
CUDA: tests/gpu/test_qk_norm_rope_store.py."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import spmd_engine.kernels.qk_norm_rope_store as fused_module
from spmd_engine.kernels.kv_quant import FP8_DTYPE
from spmd_engine.kernels.kv_store import store_kv
from spmd_engine.kernels.qk_norm_rope_store import qk_norm_rope_store
from spmd_engine.kernels.reference import qk_norm_rope_store_reference
from spmd_engine.kernels.rms_norm import rms_norm_pair
from spmd_engine.kernels.rotary import apply_rotary
from tests.kernels.paged_batch import DEVICE

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # triton interpreter noise
EPS = 1e-6


@dataclass
class Layer:
    """One layer's inputs: q/k/v as strided views of a fused qkv row (plus an unrelated tail column block)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


def qkv_views(tokens: int, hq: int, hkv: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator,
              device: torch.device = DEVICE) -> tuple[torch.Tensor, ...]:
    """q, k, v as strided views of one qkv row per token (8 unrelated columns after it), and cos/sin."""
    width = (hq + 2 * hkv) * head_dim
    qkv = (3 * torch.randn(tokens, width + 8, generator=gen)).to(dtype).to(device)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim: (hq + hkv) * head_dim].view(tokens, hkv, head_dim)
    v = qkv[:, (hq + hkv) * head_dim: width].view(tokens, hkv, head_dim)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 50
    return q, k, v, angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)


def make_layer(tokens: int, hq: int, hkv: int, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype,
               block_size: int, norms: bool, slot_dtype: torch.dtype = torch.int64, seed: int = 0,
               device: torch.device = DEVICE) -> Layer:
    gen = torch.Generator().manual_seed(seed)
    q, k, v, cos, sin = qkv_views(tokens, hq, hkv, head_dim, dtype, gen, device)
    blocks = -(-tokens // block_size) + 2
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[torch.rand(tokens, generator=gen) < 0.3] = -1  # padding rows
    shape = (blocks, block_size, hkv, head_dim)
    fp8 = cache_dtype == FP8_DTYPE
    if fp8:  # garbage bytes where nothing is written: they must stay
        k_cache = torch.randint(0, 0x7F, shape, generator=gen, dtype=torch.uint8).view(FP8_DTYPE).to(device)
        v_cache = torch.randint(0x80, 0xFF, shape, generator=gen, dtype=torch.uint8).view(FP8_DTYPE).to(device)
        scales = 2.0 ** torch.randint(-4, 3, (2, hkv), generator=gen).float()
        k_scale, v_scale = scales[0].to(device), scales[1].to(device)
    else:
        k_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(device)
        v_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(device)
        k_scale = v_scale = None
    weights = (1 + 0.3 * torch.randn(2, head_dim, generator=gen)).to(dtype).to(device) if norms else None
    return Layer(q, k, v, cos, sin, slots.to(slot_dtype).to(device), k_cache, v_cache,
                 None if weights is None else weights[0], None if weights is None else weights[1], k_scale, v_scale)


def unfused(layer: Layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Today's chain of kernels on copies of the caches: (q for attention, k_cache, v_cache)."""
    k_cache, v_cache = layer.k_cache.clone(), layer.v_cache.clone()
    q, k = layer.q, layer.k
    if layer.q_weight is not None:
        q, k = rms_norm_pair(q, layer.q_weight, k, layer.k_weight, EPS)
    q, k = apply_rotary(q, layer.cos, layer.sin), apply_rotary(k, layer.cos, layer.sin)
    store_kv(k, layer.v, k_cache, v_cache, layer.slots, layer.k_scale, layer.v_scale)
    return q, k_cache, v_cache


def fused(layer: Layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k_cache, v_cache = layer.k_cache.clone(), layer.v_cache.clone()
    q = qk_norm_rope_store(layer.q, layer.k, layer.v, layer.cos, layer.sin, k_cache, v_cache, layer.slots,
                           layer.q_weight, layer.k_weight, EPS, layer.k_scale, layer.v_scale)
    return q, k_cache, v_cache


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    a_bytes, b_bytes = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    differ = (a_bytes != b_bytes).sum().item()
    assert differ == 0, f"{what}: {differ} of {a_bytes.numel()} bytes differ"


# (tokens, Hq, Hkv, head_dim, dtype, cache dtype, block size, norms)
CASES = [
    pytest.param(9, 4, 2, 16, torch.float32, torch.float32, 4, True, id="qwen3-fp32-gqa2-bs4"),
    pytest.param(7, 6, 2, 32, torch.float16, torch.float16, 16, True, id="qwen3-fp16-gqa3-bs16"),
    pytest.param(6, 4, 1, 16, torch.bfloat16, torch.bfloat16, 8, True, id="qwen3-bf16-mqa"),
    pytest.param(5, 4, 2, 24, torch.float16, FP8_DTYPE, 4, True, id="qwen3-fp16-fp8-d24"),
    pytest.param(8, 4, 4, 16, torch.float32, FP8_DTYPE, 16, False, id="llama-fp32-fp8"),
    pytest.param(7, 6, 3, 32, torch.float16, torch.float16, 8, False, id="llama-fp16-gqa2"),
    pytest.param(5, 2, 2, 16, torch.float32, torch.float16, 4, False, id="llama-cast-cache"),
]


@pytest.mark.parametrize("tokens,hq,hkv,head_dim,dtype,cache_dtype,block_size,norms", CASES)
def test_fused_equals_the_unfused_kernels_bit_for_bit(tokens, hq, hkv, head_dim, dtype, cache_dtype, block_size,
                                                      norms):
    if DEVICE.type == "cuda" and dtype == torch.float32:
        pytest.skip("float32 on CUDA is not routed to the fusion (can_fuse; tests/gpu/test_qk_norm_rope_store.py)")
    layer = make_layer(tokens, hq, hkv, head_dim, dtype, cache_dtype, block_size, norms, seed=tokens)
    for got, want, what in zip(fused(layer), unfused(layer), ("q", "k_cache", "v_cache")):
        assert_same_bits(got, want, what)


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_every_head_grouping_writes_the_same_bits(monkeypatch, rows):
    """On the GPU the heads per program follow the token count; each grouping (a partial last group of 6 q
    heads, kv groups wider than Hkv) gives the same bits, int32 slots and an fp8 cache included."""
    layer = make_layer(5, 6, 2, 16, torch.float16, FP8_DTYPE, 4, True, slot_dtype=torch.int32, seed=3)
    want = unfused(layer)
    monkeypatch.setattr(fused_module, "rows_per_program", lambda *args: rows)
    for got, ref, what in zip(fused(layer), want, ("q", "k_cache", "v_cache")):
        assert_same_bits(got, ref, what)


@pytest.mark.parametrize("norms,cache_dtype", [(True, torch.float32), (False, FP8_DTYPE)])
def test_close_to_the_torch_reference(norms, cache_dtype):
    if DEVICE.type == "cuda":
        pytest.skip("float32 on CUDA is not routed to the fusion (can_fuse; tests/gpu/test_qk_norm_rope_store.py)")
    layer = make_layer(6, 4, 2, 16, torch.float32, cache_dtype, 4, norms, seed=11)
    k_cache, v_cache = layer.k_cache.clone(), layer.v_cache.clone()
    q_ref = qk_norm_rope_store_reference(layer.q, layer.k, layer.v, layer.cos, layer.sin, k_cache, v_cache,
                                         layer.slots, layer.q_weight, layer.k_weight, EPS, layer.k_scale,
                                         layer.v_scale)
    q, k_fused, v_fused = fused(layer)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    if cache_dtype == FP8_DTYPE:  # quantized: exact but for a rare 1-step tie (kv_store has the exact test)
        torch.testing.assert_close(k_fused.float(), k_cache.float(), atol=0.07, rtol=0.07)
    else:
        torch.testing.assert_close(k_fused, k_cache, atol=1e-5, rtol=1e-5)
    assert_same_bits(v_fused, v_cache, "v_cache")


def test_padding_rows_store_nothing_and_an_empty_batch_is_a_no_op():
    layer = make_layer(4, 2, 2, 16, torch.float16, torch.float16, 4, True)
    layer.slots.fill_(-1)
    q, k_cache, v_cache = fused(layer)
    assert_same_bits(k_cache, layer.k_cache, "k_cache")
    assert_same_bits(v_cache, layer.v_cache, "v_cache")
    assert_same_bits(q, unfused(layer)[0], "q")  # q is still computed for every row
    empty = make_layer(0, 2, 2, 16, torch.float16, torch.float16, 4, True)
    assert fused(empty)[0].shape == (0, 2, 16)


def test_bad_inputs_are_clear_errors():
    # float16: a float32 layer on CUDA is refused by can_fuse before the checks below
    layer = make_layer(3, 2, 2, 16, torch.float16, torch.float16, 4, True)
    with pytest.raises(ValueError, match="come together"):
        qk_norm_rope_store(layer.q, layer.k, layer.v, layer.cos, layer.sin, layer.k_cache, layer.v_cache,
                           layer.slots, layer.q_weight, None, EPS)
    with pytest.raises(ValueError, match="cos/sin must be"):
        qk_norm_rope_store(layer.q, layer.k, layer.v, layer.cos[:, :4], layer.sin[:, :4], layer.k_cache,
                           layer.v_cache, layer.slots)
    with pytest.raises(ValueError, match="heads/head_dim"):
        qk_norm_rope_store(layer.q, layer.k, layer.v, layer.cos, layer.sin, layer.k_cache[:, :, :1],
                           layer.v_cache[:, :, :1], layer.slots)

