"""Triton SwiGLU gate: silu(gate) * up of a packed [T, 2d] projection in one launch (not two)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.pdl import pdl_launch, pdl_prologue

BLOCK = 1024


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in float32, rounded to `dtype`; also the GEMV's fused input (kernels/gemv.py)."""
    gate = gate.to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)).to(dtype)


@triton.jit
def _silu_and_mul_kernel(x, out, width, stride_x_row, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x + row * stride_x_row + cols, mask=mask, other=0.0)
    up = tl.load(x + row * stride_x_row + width + cols, mask=mask, other=0.0)
    tl.store(out + row * width + cols, silu_mul(gate, up, out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2d] (gate | up, last dim contiguous) -> [T, d]."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"silu_and_mul: x must be [T, 2d] with a contiguous last dim, got {tuple(x.shape)}")
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(width, BLOCK))](x, out, width, x.stride(0), BLOCK=BLOCK,
                                                                 num_warps=4, **pdl_launch(x.device))
    return out
