"""Triton rotary embedding (rotate-half layout) for all heads of a token in one program.

Replaces ~7 elementwise launches per call (two halves, four products, sub, add, cat) with one; the
products run in float32 and are rounded once. Input may be a strided view of the fused qkv output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.pdl import pdl_launch, pdl_prologue


@triton.jit
def _rotary_kernel(
    x, cos, sin, out, num_heads, half, stride_x_tok, stride_x_head, stride_cs_tok,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    dim_ok = dims < half
    mask = (heads < num_heads) & dim_ok
    base = x + tok * stride_x_tok + heads * stride_x_head + dims
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos + tok * stride_cs_tok + dims, mask=dim_ok, other=0.0).to(tl.float32)
    s = tl.load(sin + tok * stride_cs_tok + dims, mask=dim_ok, other=0.0).to(tl.float32)
    dst = out + tok * num_heads * 2 * half + heads * 2 * half + dims
    tl.store(dst, (x1 * c - x2 * s).to(out.dtype.element_ty), mask=mask)
    tl.store(dst + half, (x2 * c + x1 * s).to(out.dtype.element_ty), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (last dim contiguous), cos/sin [T, D/2] -> rotated x, contiguous, x's dtype."""
    num_tokens, num_heads, head_dim = x.shape
    half = head_dim // 2
    if x.stride(2) != 1 or head_dim % 2:
        raise ValueError(f"apply_rotary: head_dim must be even with a contiguous last dim, "
                         f"got shape {tuple(x.shape)} strides {x.stride()}")
    if cos.shape != (num_tokens, half) or sin.shape != cos.shape or cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError(f"apply_rotary: cos/sin must both be [{num_tokens}, {half}] with equal strides, "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens:
        block_h, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(half)
        _rotary_kernel[(num_tokens,)](
            x, cos, sin, out, num_heads, half, x.stride(0), x.stride(1), cos.stride(0),
            BLOCK_D=block_d, BLOCK_H=block_h, num_warps=1 if block_h * block_d <= 512 else 4,
            **pdl_launch(x.device),
        )
    return out
