"""Which shapes the Triton attention kernels handle, checked in one place.

The engine asks `supports_shape` before choosing a kernel and falls back to the torch reference
otherwise; the kernels call `check_attention_inputs` so a bad call fails with one clear line.
"""
from __future__ import annotations

import torch

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT8_SCALE_BYTES = 4  # an int8 cache row: head_dim int8 values, then the row's float32 scale (kernels/reference.py)


def is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def supports_shape(block_size: int, head_dim: int) -> bool:
    """Any power-of-two KV block size; head dims the tiles are built for."""
    return is_power_of_two(block_size) and head_dim in SUPPORTED_HEAD_DIMS


def is_int8_cache(k_cache: torch.Tensor) -> bool:
    """An int8 cache (`kv_cache_dtype=int8`): the kernels read Hadamard-rotated rows with a scale per row, so
    their query and output are in the rotated basis (`x H`; the backend rotates them, kernels/kv_int8.py)."""
    return k_cache.dtype == torch.int8


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs keep full precision (no tf32) so they match the fp32 reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_attention_inputs(
    kernel: str, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """Raise ValueError naming the offending field when the kernel cannot run these tensors."""
    num_q_heads, head_dim = query.shape[-2], query.shape[-1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{kernel}: head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if not is_power_of_two(block_size):
        raise ValueError(f"{kernel}: block_size must be a power of two, got {block_size}")
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{kernel}: dtype must be fp16, bf16 or fp32, got {query.dtype}")
    row = head_dim + (INT8_SCALE_BYTES if k_cache.dtype == torch.int8 else 0)  # an int8 row ends in its scale
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != row:
        raise ValueError(
            f"{kernel}: k_cache/v_cache must both be [N, block_size, Hkv, {row}], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"{kernel}: query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(
            f"{kernel}: k_cache and v_cache must share strides with a contiguous head_dim, "
            f"got {k_cache.stride()} and {v_cache.stride()}"
        )
