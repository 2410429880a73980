"""Triton RMSNorm, optionally fused with the residual add before it: one launch instead of ~8;
and two RMSNorms in one launch (Qwen3's per-head q and k norms).

Same math as `models/layers/norm.py` (HF Llama/Qwen3): the sum `x + residual` is rounded to the
input dtype, the normalisation runs in float32 and is rounded before the weight multiply. Rows may
be a strided [T, H, D] view (Qwen3's per-head q/k norm on a slice of the fused qkv projection).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.pdl import pdl_launch, pdl_prologue


@triton.jit
def _rms_norm_kernel(
    x, residual, weight, out, residual_out,
    heads, stride_x_tok, stride_x_head, stride_res_row, num_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
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
    w = tl.load(weight + cols, mask=mask, other=0.0)
    tl.store(out + row.to(tl.int64) * num_cols + cols, _normalize(values, w, num_cols, eps, out.dtype.element_ty),
             mask=mask)


@triton.jit
def _normalize(values, w, num_cols, eps, dtype: tl.constexpr):
    """w * (x / rms(x)) with the normalisation in float32, rounded to `dtype` before the weight."""
    xf = values.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / num_cols + eps)
    normed = (xf * inv_rms).to(dtype).to(tl.float32)
    return (normed * w.to(tl.float32)).to(dtype)


@triton.jit
def _rms_norm_pair_kernel(
    a, b, a_weight, b_weight, a_out, b_out,
    heads_a, heads_b, stride_a_tok, stride_a_head, stride_b_tok, stride_b_head, num_cols, eps,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per (token, head) of a then b: heads [0, heads_a) are a's, the rest b's."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    tok = (row // (heads_a + heads_b)).to(tl.int64)
    head = row % (heads_a + heads_b)
    in_b = head >= heads_a
    head_b = tl.maximum(head - heads_a, 0)
    cols = tl.arange(0, BLOCK)
    mask_a = cols < tl.where(in_b, 0, num_cols)  # one of the two loads / stores is fully masked: no traffic
    mask_b = cols < tl.where(in_b, num_cols, 0)
    values = tl.where(in_b, tl.load(b + tok * stride_b_tok + head_b * stride_b_head + cols, mask=mask_b, other=0.0),
                      tl.load(a + tok * stride_a_tok + head * stride_a_head + cols, mask=mask_a, other=0.0))
    w = tl.where(in_b, tl.load(b_weight + cols, mask=mask_b, other=0.0),
                 tl.load(a_weight + cols, mask=mask_a, other=0.0))
    normed = _normalize(values, w, num_cols, eps, a_out.dtype.element_ty)
    tl.store(a_out + (tok * heads_a + head) * num_cols + cols, normed, mask=mask_a)
    tl.store(b_out + (tok * heads_b + head_b) * num_cols + cols, normed, mask=mask_b)


def _launch_options(num_cols: int) -> dict[str, int]:
    block = triton.next_power_of_2(num_cols)
    return {"BLOCK": block, "num_warps": 1 if block <= 256 else (4 if block <= 2048 else 8)}


def rms_norm_pair(
    a: torch.Tensor,  # [T, Ha, N], last dim contiguous (Qwen3's q heads, a strided slice of qkv)
    a_weight: torch.Tensor,  # [N]
    b: torch.Tensor,  # [T, Hb, N], same dtype (the k heads)
    b_weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(a, a_weight, eps), rms_norm(b, b_weight, eps))` in one launch, the same bits."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[2] \
            or a.stride(-1) != 1 or b.stride(-1) != 1 or a.dtype != b.dtype:
        raise ValueError(f"rms_norm_pair: a and b must be [T, H, N] of one dtype with the same T and N and a "
                         f"contiguous last dim, got {tuple(a.shape)} and {tuple(b.shape)}")
    num_cols = a.shape[2]
    if a_weight.shape != (num_cols,) or b_weight.shape != (num_cols,):
        raise ValueError(f"rms_norm_pair: weights must be [{num_cols}], got {tuple(a_weight.shape)}, "
                         f"{tuple(b_weight.shape)}")
    a_out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    b_out = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    rows = a.shape[0] * (a.shape[1] + b.shape[1])
    if rows:
        _rms_norm_pair_kernel[(rows,)](
            a, b, a_weight, b_weight, a_out, b_out, a.shape[1], b.shape[1],
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), num_cols, eps, **_launch_options(num_cols),
            **pdl_launch(a.device),
        )
    return a_out, b_out


def rms_norm(
    x: torch.Tensor,  # [T, N] or [T, H, N]; the last dim contiguous
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # same shape as x, contiguous rows
    residual_out: torch.Tensor | None = None,  # where x + residual goes (contiguous; may be `residual` itself)
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`norm(x)`, or with `residual` `(norm(x + residual), x + residual)`; outputs are contiguous. With
    `residual_out` the sum is written there: each row is read before it is written, so it may be `residual`
    (the residual stream updated in place, as RMSNorm does on CUDA)."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"rms_norm: x must be [T, N] or [T, H, N] with a contiguous last dim, got {tuple(x.shape)}")
    num_cols = x.shape[-1]
    if weight.shape != (num_cols,):
        raise ValueError(f"rms_norm: weight must be [{num_cols}], got {tuple(weight.shape)}")
    heads = x.shape[1] if x.dim() == 3 else 1
    stride_head = x.stride(1) if x.dim() == 3 else 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        residual_out = out  # unwritten without HAS_RESIDUAL
    else:
        if residual.shape != x.shape:
            raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        residual = residual.reshape(-1, num_cols)
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        elif residual_out.shape != x.shape or residual_out.dtype != x.dtype or not residual_out.is_contiguous():
            raise ValueError(f"rms_norm: residual_out must be a contiguous {tuple(x.shape)} {x.dtype} tensor")
    rows = x.shape[0] * heads
    if rows:
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, residual_out,
            heads, x.stride(0), stride_head, residual.stride(0) if residual is not None else 0, num_cols, eps,
            HAS_RESIDUAL=residual is not None, **_launch_options(num_cols), **pdl_launch(x.device),
        )
    return out if residual is None else (out, residual_out)
