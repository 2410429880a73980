"""Triton write of this step's keys/values into the paged KV cache (one program per token).

Equivalent to `reference.store_kv_reference`; padded tokens (slot -1) are skipped on the device,
so the launch shape depends only on the token count (safe inside a captured CUDA graph). A
float8_e4m3fn cache is written as `x / scale` per KV head, saturated at +-448 and rounded to
nearest-even in float32 arithmetic first (`_round_to_e4m3`), so the final cast is exact: the bytes
equal torch's `.to(float8_e4m3fn)` on CUDA and under TRITON_INTERPRET (whose own float->fp8 cast
drops the carry of a rounded-up mantissa); its V goes in pairs of positions (`kv_quant.FP8_V_LAYOUT`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.kv_quant import FP8_MAX, check_kv_scales
from spmd_engine.kernels.paged_kv_tile import fp8_v_offset
from spmd_engine.kernels.pdl import pdl_launch, pdl_prologue

_E4M3_MAX = tl.constexpr(FP8_MAX)
_E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2**-6; below it e4m3fn is subnormal, a fixed step of 2**-9
_E4M3_SUBNORMAL_ROUNDER = tl.constexpr(24576.0)  # 1.5 * 2**14: float32's ulp there is 2**-9: +c-c rounds


@triton.jit
def _round_to_e4m3(x):
    """float32 -> the nearest (ties to even) float8_e4m3fn value, as float32; saturates at +-448."""
    x = tl.minimum(tl.maximum(x, -_E4M3_MAX), _E4M3_MAX)
    bits = x.to(tl.int32, bitcast=True)
    # normal range: keep 3 of float32's 23 mantissa bits (a carry may bump the exponent, as it should)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == ~0xFFFFF
    normal = rounded.to(tl.float32, bitcast=True)
    # subnormal range: a multiple of 2**-9, rounded by float32 addition itself; the sign bit copied back
    # (on an H200, `where(bits < 0, -m, m)` wrote +0 for negative values that round to zero; torch writes 0x80)
    magnitude = (tl.abs(x) + _E4M3_SUBNORMAL_ROUNDER) - _E4M3_SUBNORMAL_ROUNDER
    sign = (bits >> 31) << 31
    subnormal = (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < _E4M3_MIN_NORMAL, subnormal, normal)


@triton.jit
def _store_kv_kernel(
    key,
    value,
    k_cache,
    v_cache,
    slot_mapping,
    k_scale,
    v_scale,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_cache_block,
    stride_cache_pos,
    stride_cache_head,
    block_size,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)
    tok = token.to(tl.int64)
    src_k = tl.load(key + tok * stride_key_tok + heads * stride_key_head + dims, mask=mask)
    src_v = tl.load(value + tok * stride_value_tok + heads * stride_value_head + dims, mask=mask)
    block = (slot // block_size) * stride_cache_block
    offset = slot % block_size
    dst = block + offset * stride_cache_pos + heads * stride_cache_head + dims
    v_dst = dst
    if QUANTIZE:  # IEEE division (div_rn, not the approximate `/`): the bytes torch writes, for any scale
        per_head = heads + 0 * dims  # [BLOCK_H, BLOCK_D]: each head's scale across its row
        k_scale_row = tl.load(k_scale + per_head, mask=mask, other=1.0)
        v_scale_row = tl.load(v_scale + per_head, mask=mask, other=1.0)
        src_k = _round_to_e4m3(tl.math.div_rn(src_k.to(tl.float32), k_scale_row))
        src_v = _round_to_e4m3(tl.math.div_rn(src_v.to(tl.float32), v_scale_row))
        v_dst = block + fp8_v_offset(offset, heads * stride_cache_head + dims, stride_cache_pos)
    tl.store(k_cache + dst, src_k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + v_dst, src_v.to(v_cache.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int32/int64; -1 = padding, skipped
    k_scale: torch.Tensor | None = None,  # [Hkv] float32, only with a float8_e4m3fn cache
    v_scale: torch.Tensor | None = None,
) -> None:
    _check_store_shapes(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_dim = key.shape
    quantize = check_kv_scales("store_kv", k_cache, k_scale, v_scale)
    if num_tokens == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    if k_cache.stride(3) != 1:
        raise ValueError("store_kv: k_cache/v_cache head_dim must be contiguous")
    block_d = triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if quantize else slot_mapping,  # unread without QUANTIZE
        v_scale if quantize else slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        num_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=block_d,
        QUANTIZE=quantize,
        num_warps=4 if num_heads * block_d >= 1024 else 1,
        **pdl_launch(key.device),
    )


def _check_store_shapes(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """Reject mismatched shapes before a launch would write out of place."""
    num_tokens, num_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"store_kv: value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("store_kv: k_cache and v_cache must have the same shape and strides")
    if tuple(k_cache.shape[2:]) != (num_heads, head_dim):
        raise ValueError(
            f"store_kv: cache heads/head_dim {tuple(k_cache.shape[2:])} != key {(num_heads, head_dim)}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"store_kv: slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
