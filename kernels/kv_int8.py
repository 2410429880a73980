"""The int8 KV cache (`kv_cache_dtype=int8`) on the Triton backend: the store, and the Hadamard rotation of the
attention's query and output.

A cache row (one token, one KV head) holds head_dim int8 values of the Hadamard-rotated K or V, then its float32
scale (kernels/reference.py, "int8 KV cache"). `store_kv_int8` rotates, quantizes and writes rows as
`store_kv_int8_reference` does; the attention kernels read the rows as they are, so their query is rotated
first (q . k = (qH) . (kH)) and their output rotated back (o = (P (vH)) H, H symmetric and its own inverse):
`rotate_rows`. Both run 16-row tiles of one fixed shape whatever the batch (a row's bits do not follow the
batch size or a graph's padding, as cuBLAS's choice of kernel by row count would make them), launch shapes
follow tensor shapes only and slot -1 is skipped on the device: CUDA-graph safe, no host sync. The rotation's
float32 sums run in the dot's order, not torch's, so a value at a rounding tie may land one int8 step from the
reference's.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.pdl import pdl_launch, pdl_prologue
from spmd_engine.kernels.reference import KV_INT8_MAX, KV_INT8_SCALE_BYTES, hadamard_reference

ROWS = 16  # rows per tile: tl.dot's least
_INT8_MAX = tl.constexpr(KV_INT8_MAX)
_ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2**23: float32's ulp there is 1, so +c-c rounds to nearest even

@functools.lru_cache(maxsize=None)
def hadamard_entry(head_dim: int) -> float:
    """|H[i, j]| = 1 / sqrt(head_dim) as the reference's float32 holds it."""
    return hadamard_reference(head_dim)[0, 0].item()


@triton.jit
def _hadamard_tile(HEAD_DIM: tl.constexpr, ENTRY: tl.constexpr):
    """H [HEAD_DIM, HEAD_DIM] float32 made in registers (no matrix in memory, nothing allocated, so nothing made
    inside a graph capture): Sylvester's H[i, j] = (-1)^popcount(i & j) / sqrt(D), the parity folded from 8 bits
    (HEAD_DIM <= 256)."""
    bits = tl.arange(0, HEAD_DIM)[:, None] & tl.arange(0, HEAD_DIM)[None, :]
    bits = bits ^ (bits >> 4)
    bits = bits ^ (bits >> 2)
    bits = bits ^ (bits >> 1)
    return tl.where((bits & 1) == 0, ENTRY, -ENTRY).to(tl.float32)


@triton.jit
def _rotate_tile(x_ptrs, live, h):
    """Rows [ROWS, D] (masked rows 0) times H, in float32."""
    x = tl.load(x_ptrs, mask=live[:, None], other=0.0).to(tl.float32)
    return tl.dot(x, h, input_precision="ieee")


@triton.jit
def _quantize_store(x_ptrs, live, h, cache, rows, HEAD_DIM: tl.constexpr):
    """Rotate rows, then store each as round(x H / s) in int8 and s = max |x H| / 127 (at least 1e-30) after it."""
    dims = tl.arange(0, HEAD_DIM)
    rotated = _rotate_tile(x_ptrs, live, h)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(rotated), axis=1), _INT8_MAX), 1e-30)
    q = tl.math.div_rn(rotated, scale[:, None])
    q = tl.minimum(tl.maximum((q + _ROUNDER) - _ROUNDER, -_INT8_MAX), _INT8_MAX)
    tl.store(cache + rows[:, None] + dims[None, :], q.to(tl.int8), mask=live[:, None])
    tl.store((cache + rows + HEAD_DIM).to(tl.pointer_type(tl.float32), bitcast=True), scale, mask=live)


@triton.jit(do_not_specialize=["num_tokens"])  # a count that follows the batch: no variant compiled mid-job
def _store_kv_int8_kernel(
    key, value, k_cache, v_cache, slot_mapping, num_tokens,
    stride_key_tok, stride_key_head, stride_value_tok, stride_value_head,
    stride_cache_block, stride_cache_pos, stride_cache_head, block_size,
    HEAD_DIM: tl.constexpr, ENTRY: tl.constexpr, BLOCK_T: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1).to(tl.int64)
    slots = tl.load(slot_mapping + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    live = slots >= 0
    slots = tl.where(live, slots, 0)
    dims = tl.arange(0, HEAD_DIM)
    h = _hadamard_tile(HEAD_DIM, ENTRY)
    rows = (slots // block_size) * stride_cache_block + (slots % block_size) * stride_cache_pos \
        + head * stride_cache_head
    tok = tokens.to(tl.int64)[:, None]
    _quantize_store(key + tok * stride_key_tok + head * stride_key_head + dims[None, :], live, h, k_cache, rows,
                    HEAD_DIM)
    _quantize_store(value + tok * stride_value_tok + head * stride_value_head + dims[None, :], live, h, v_cache,
                    rows, HEAD_DIM)


def store_kv_int8(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """`store_kv_int8_reference` in one launch: key/value [T, Hkv, D] rotated, quantized per row and written
    with their scales into the int8 caches [N, bs, Hkv, D + 4] at `slot_mapping` (-1: skipped)."""
    num_tokens, num_heads, head_dim = key.shape
    if value.shape != key.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"store_kv_int8: key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} do not match")
    row = head_dim + KV_INT8_SCALE_BYTES
    if (k_cache.dtype != torch.int8 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride()
            or tuple(k_cache.shape[2:]) != (num_heads, row) or k_cache.stride(3) != 1):
        raise ValueError(f"store_kv_int8: k_cache/v_cache must both be int8 [N, bs, {num_heads}, {row}] with "
                         f"contiguous rows, got {tuple(k_cache.shape)} {k_cache.dtype}")
    if num_tokens == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    _store_kv_int8_kernel[(triton.cdiv(num_tokens, ROWS), num_heads)](
        key, value, k_cache, v_cache, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1],
        HEAD_DIM=head_dim, ENTRY=hadamard_entry(head_dim), BLOCK_T=ROWS, num_warps=4 if head_dim >= 128 else 1,
        **pdl_launch(key.device),
    )


@triton.jit(do_not_specialize=["num_rows"])
def _rotate_rows_kernel(x, out, num_rows, num_heads, stride_x_tok, stride_x_head, stride_o_tok, stride_o_head,
                        HEAD_DIM: tl.constexpr, ENTRY: tl.constexpr, BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < num_rows
    tok, head = (rows // num_heads).to(tl.int64), rows % num_heads
    dims = tl.arange(0, HEAD_DIM)[None, :]
    h = _hadamard_tile(HEAD_DIM, ENTRY)
    rotated = _rotate_tile(x + (tok * stride_x_tok + head * stride_x_head)[:, None] + dims, live, h)
    tl.store(out + (tok * stride_o_tok + head * stride_o_head)[:, None] + dims, rotated.to(out.dtype.element_ty),
             mask=live[:, None])


def rotate_rows(x: torch.Tensor, out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, H, D] (any token and head strides) times the Hadamard matrix in float32, rounded once to `dtype`
    (x's by default), into `out` [T, H, D] when given (a new contiguous tensor otherwise): the query's rotation
    before int8-cache attention and the output's after it."""
    num_tokens, num_heads, head_dim = x.shape
    if out is None:
        out = torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device)
    if out.shape != x.shape or x.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError(f"rotate_rows: x {tuple(x.shape)} and out {tuple(out.shape)} must match, head_dim contiguous")
    num_rows = num_tokens * num_heads
    if num_rows:
        _rotate_rows_kernel[(triton.cdiv(num_rows, ROWS),)](
            x, out, num_rows, num_heads, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, ENTRY=hadamard_entry(head_dim), BLOCK_R=ROWS, num_warps=4 if head_dim >= 128 else 1,
            **pdl_launch(x.device))
    return out
