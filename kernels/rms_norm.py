"""Triton RMSNorm, optionally fused with the residual add before it: one launch instead of ~8.

Same math as `models/layers/norm.py` (HF Llama/Qwen3): the sum `x + residual` is rounded to the
input dtype, the normalisation runs in float32 and is rounded before the weight multiply. Rows may
be a strided [T, H, D] view (Qwen3's per-head q/k norm on a slice of the fused qkv projection).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x, residual, weight, out, residual_out,
    heads, stride_x_tok, stride_x_head, stride_res_row, num_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    tok = (row // heads).to(tl.int64)
    head = (row % heads).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    values = tl.load(x + tok * stride_x_tok + head * stride_x_head + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(residual + row.to(tl.int64) * stride_res_row + cols, mask=mask, other=0.0)
        values = (values.to(tl.float32) + res.to(tl.float32)).to(out.dtype.element_ty)
        tl.store(residual_out + row.to(tl.int64) * num_cols + cols, values, mask=mask)
    xf = values.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / num_cols + eps)
    normed = (xf * inv_rms).to(out.dtype.element_ty).to(tl.float32)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row.to(tl.int64) * num_cols + cols, (normed * w).to(out.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, N] or [T, H, N]; the last dim contiguous
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # same shape as x, contiguous rows
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`norm(x)`, or with `residual` `(norm(x + residual), x + residual)`; outputs are contiguous."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"rms_norm: x must be [T, N] or [T, H, N] with a contiguous last dim, got {tuple(x.shape)}")
    num_cols = x.shape[-1]
    if weight.shape != (num_cols,):
        raise ValueError(f"rms_norm: weight must be [{num_cols}], got {tuple(weight.shape)}")
    heads = x.shape[1] if x.dim() == 3 else 1
    stride_head = x.stride(1) if x.dim() == 3 else 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = out
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        residual = residual.reshape(-1, num_cols)
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.shape[0] * heads
    if rows:
        block = triton.next_power_of_2(num_cols)
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, residual_out,
            heads, x.stride(0), stride_head, residual.stride(0) if residual is not None else 0, num_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=1 if block <= 256 else (4 if block <= 2048 else 8),
        )
    return out if residual is None else (out, residual_out)
