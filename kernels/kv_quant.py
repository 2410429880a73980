"""FP8 (e4m3fn) KV-cache storage: the dtype, its range, per-KV-head scales and their checks.

A quantized cache stores `clamp(x / scale, -448, 448)` rounded to float8_e4m3fn; reading it back
is `fp8.float() * scale`. Scales are float32 tensors [num_kv_heads] per layer, one for K and one
for V. An fp8 V cache stores positions in pairs (`FP8_V_LAYOUT`, below); K keeps the plain layout.
Every scale the engine makes is a power of two, so dividing and multiplying by it are exact
and the torch reference and the Triton store kernel write bit-identical bytes. Plain torch only:
this module is imported on the CPU path too.
"""
from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value; larger magnitudes are clamped (saturated)


# The fp8 V cache's layout. Each [block_size, Hkv, D] block holds [block_size / 2, Hkv, D, 2]: the two
# positions 2j and 2j + 1 of a (head, dim) side by side. Why: the P.V dot's operand holds two positions of
# one dim in one register; from a plain layout Triton fetched them as two byte loads from shared memory
# (128 per thread per tile), from pairs as one 16-bit load. H200, B = 256 x 2,048
# (`python launch/bench/bench_attention.py`): 400.8 -> 378.8 us per decode launch, the same output bits. The K
# cache keeps the plain
# layout (q.k's operand pairs two dims of one position, adjacent already). The tensor keeps the
# [N, block_size, Hkv, D] shape and strides; only the order of the bytes in a block differs.
FP8_V_LAYOUT = "pairs of positions: [block, block_size / 2, Hkv, D, 2]"


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def v_pairs(v_cache: torch.Tensor) -> torch.Tensor:
    """An fp8 V cache [N, bs, Hkv, D] as its stored layout [N, bs / 2, Hkv, D, 2] (a view)."""
    n, block_size, heads, dim = v_cache.shape
    return v_cache.view(n, block_size // 2, heads, dim, 2)


def read_v_blocks(v_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks of an fp8 V cache in position order: [len(blocks), bs, Hkv, D] (a copy)."""
    _, block_size, heads, dim = v_cache.shape
    return v_pairs(v_cache)[blocks].permute(0, 1, 4, 2, 3).reshape(len(blocks), block_size, heads, dim)


def write_v_positions(v_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                      values: torch.Tensor) -> None:
    """v_cache[blocks[i], offsets[i]] = values[i] ([T, Hkv, D], already float8) in the pair layout."""
    v_pairs(v_cache)[blocks, offsets // 2, :, :, offsets % 2] = values


def quantize_fp8_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D] (any float dtype), scale [Hkv] float32 -> float8_e4m3fn, saturating."""
    return (x.float() / scale[None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def pow2_scale_for_absmax(absmax: float, headroom: float) -> float:
    """The smallest power of two s with absmax * headroom / s <= FP8_MAX (1.0 for an all-zero head).

    Rounding up to a power of two keeps quantization exact to undo and identical on every backend;
    `headroom` leaves room for values larger than the ones the scale was measured on.
    """
    if not math.isfinite(absmax) or absmax <= 0.0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(absmax * headroom / FP8_MAX))


def check_kv_scales(
    kernel: str, k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> bool:
    """True when the cache is fp8 (and its scales are usable); raise ValueError naming the problem."""
    if not is_fp8(k_cache.dtype):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{kernel}: k_scale/v_scale are only for a float8_e4m3fn cache, got {k_cache.dtype}")
        return False
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size % 2 or k_cache.stride()[1:] != (num_kv_heads * head_dim, head_dim, 1):
        raise ValueError(f"{kernel}: a float8_e4m3fn KV cache needs an even block_size and contiguous blocks "
                         f"(V stores pairs of positions), got block_size {block_size}, strides {k_cache.stride()}")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise ValueError(f"{kernel}: a float8_e4m3fn KV cache needs {name} ([{num_kv_heads}] float32)")
        if scale.dtype != torch.float32 or tuple(scale.shape) != (num_kv_heads,) or not scale.is_contiguous():
            raise ValueError(
                f"{kernel}: {name} must be a contiguous [{num_kv_heads}] float32 tensor, "
                f"got {tuple(scale.shape)} {scale.dtype}"
            )
        if scale.device != k_cache.device:
            raise ValueError(f"{kernel}: {name} is on {scale.device}, the cache on {k_cache.device}")
    return True
