"""Triton W8A8 GEMV for small batches (1 <= M <= 16 rows: decode): y[M, N] = qa[M, K] . qw[N, K]^T, scaled.

Why: at decode batch sizes the matmul's cost is reading the weights, and fp8 weights are half the bytes of
bf16 ones. One program owns BLOCK_N weight rows and walks the whole K once, computing them for all M rows
together ("swap AB": the weight tile is the MMA's long side, the <= 16 activation rows its short side), so W
is read exactly once whatever M is. Scaling as `kernels/fp8_gemm.py`: per K step one activation scale per
row and one weight scale per weight row.

Determinism: BLOCK_M is always 16 (padding rows load zeros) and M is not specialised on, so every M <= 16
runs the same compiled kernel; a row's result depends only on its own activations, and the block choice
only on (N, K): row i of a batch of 3 equals row i of the same batch padded to 4 (a CUDA graph) bitwise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.fp8_act_quant import pow2_scale, round_to_e4m3
from spmd_engine.kernels.fp8_gemm import k_step
from spmd_engine.kernels.reference import FP8_E4M3_MAX, FP8_MIN_AMAX
from spmd_engine.kernels.silu_and_mul import silu_mul

FP8_GEMV_MAX_M = 16
TARGET_PROGRAMS = 264  # 2 per SM of an H200


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(a, a_scale, w, w_scale, bias, out,
                     M, N, K, stride_am, stride_asm, stride_wn, stride_wsn, stride_om,
                     GROUP: tl.constexpr, BN_W: tl.constexpr, BK_W: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, FP8_DOT: tl.constexpr):
    BLOCK_M: tl.constexpr = 16
    pid_n = tl.program_id(0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows = output columns
    rows = tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    w_rows = w + cols.to(tl.int64)[:, None] * stride_wn
    a_rows = a + rows.to(tl.int64)[:, None] * stride_am
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        qw = tl.load(w_rows + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        qa = tl.load(a_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if FP8_DOT:
            part = tl.dot(qw, tl.trans(qa))
        else:
            part = tl.dot(qw.to(tl.float32), tl.trans(qa.to(tl.float32)))
        sw = tl.load(w_scale + (cols // BN_W) * stride_wsn + k0 // BK_W, mask=col_ok, other=0.0)
        sa = tl.load(a_scale + rows * stride_asm + k0 // GROUP, mask=row_ok, other=0.0)
        acc += part * sw[:, None] * sa[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out + rows.to(tl.int64)[None, :] * stride_om + cols[:, None], acc.to(out.dtype.element_ty),
             mask=col_ok[:, None] & row_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_fused_kernel(x, w, w_scale, bias, out,
                           M, N, K, stride_xm, stride_wn, stride_wsn, stride_om,
                           BN_W: tl.constexpr, BK_W: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                           HAS_BIAS: tl.constexpr, GATED: tl.constexpr, FP8_DOT: tl.constexpr):
    """`_fp8_gemv_kernel` quantizing its activations itself: each K step is one activation group, whose scale
    and e4m3 values it computes as kernels/fp8_act_quant.py does (the same bits), so no launch of its own."""
    BLOCK_M: tl.constexpr = 16
    pid_n = tl.program_id(0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    ks = tl.arange(0, GROUP)
    w_rows = w + cols.to(tl.int64)[:, None] * stride_wn
    x_rows = x + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, GROUP):
        qw = tl.load(w_rows + (k0 + ks)[None, :], mask=col_ok[:, None], other=0.0)
        if GATED:
            gate = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None], other=0.0)
            up = tl.load(x_rows + K + (k0 + ks)[None, :], mask=row_ok[:, None], other=0.0)
            v = silu_mul(gate, up, x.dtype.element_ty).to(tl.float32)
        else:
            v = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(v), axis=1), FP8_MIN_AMAX)
        sa, inverse = pow2_scale(amax)
        r = round_to_e4m3(tl.minimum(tl.maximum(v * inverse[:, None], -FP8_E4M3_MAX), FP8_E4M3_MAX))
        qa = r.to(w.dtype.element_ty)
        if FP8_DOT:
            part = tl.dot(qw, tl.trans(qa))
        else:
            part = tl.dot(qw.to(tl.float32), tl.trans(qa.to(tl.float32)))
        sw = tl.load(w_scale + (cols // BN_W) * stride_wsn + k0 // BK_W, mask=col_ok, other=0.0)
        acc += part * sw[:, None] * sa[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out + rows.to(tl.int64)[None, :] * stride_om + cols[:, None], acc.to(out.dtype.element_ty),
             mask=col_ok[:, None] & row_ok[None, :])


def fusable(k: int, group: int, block_k: int) -> bool:
    """Whether `fp8_gemv_fused` takes this layer: groups of 32..128 columns that tile K and the weight blocks."""
    return (group in (32, 64, 128) and k % group == 0 and (block_k >= k or block_k % group == 0))


def fp8_gemv_fused(x: torch.Tensor, group: int, qw: torch.Tensor, w_scale: torch.Tensor, block_n: int, block_k: int,
                   bias: torch.Tensor | None, out_dtype: torch.dtype, gated: bool = False,
                   rows_per_program: int | None = None) -> torch.Tensor:
    """x [M <= 16, K] (gated: [M, 2K]) 16/32-bit, quantized inside the GEMV -> [M, N]: the bits of
    `fp8_act_quant` then `fp8_gemv`."""
    m = x.shape[0]
    n, k = qw.shape
    if m > FP8_GEMV_MAX_M or not fusable(k, group, block_k) or x.stride(1) != 1:
        raise ValueError(f"fp8_gemv_fused: M={m} K={k} group={group} block_k={block_k} is not a fused shape")
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    block = rows_per_program or gemv_block_n(n)
    _fp8_gemv_fused_kernel[(triton.cdiv(n, block),)](
        x, qw, w_scale, bias if bias is not None else out, out,
        m, n, k, x.stride(0), qw.stride(0), w_scale.stride(0), out.stride(0),
        BN_W=block_n, BK_W=block_k if block_k < k else k + group, BLOCK_N=block, GROUP=group,
        HAS_BIAS=bias is not None, GATED=gated, FP8_DOT=x.is_cuda, num_warps=4, num_stages=4)
    return out


def gemv_block_n(n: int) -> int:
    """Weight rows per program: 64, halved (down to 16) until the launch has ~TARGET_PROGRAMS programs."""
    block = 64
    while block > 16 and triton.cdiv(n, block) < TARGET_PROGRAMS:
        block //= 2
    return block


def fp8_gemv(qa: torch.Tensor, a_scale: torch.Tensor, group: int, qw: torch.Tensor, w_scale: torch.Tensor,
             block_n: int, block_k: int, bias: torch.Tensor | None, out_dtype: torch.dtype,
             rows_per_program: int | None = None) -> torch.Tensor:
    """The operands of `kernels/fp8_gemm.fp8_gemm` with M <= 16 -> [M, N] in `out_dtype`."""
    m, k = qa.shape
    n = qw.shape[0]
    if m > FP8_GEMV_MAX_M:
        raise ValueError(f"fp8_gemv takes at most {FP8_GEMV_MAX_M} rows, got {m}")
    out = torch.empty(m, n, dtype=out_dtype, device=qa.device)
    if m == 0:
        return out
    step = k_step(k, group, block_k)
    block = rows_per_program or gemv_block_n(n)
    _fp8_gemv_kernel[(triton.cdiv(n, block),)](
        qa, a_scale, qw, w_scale, bias if bias is not None else out, out,
        m, n, k, qa.stride(0), a_scale.stride(0), qw.stride(0), w_scale.stride(0), out.stride(0),
        GROUP=group, BN_W=block_n, BK_W=block_k if block_k < k else k + step, BLOCK_N=block, BLOCK_K=step,
        HAS_BIAS=bias is not None, FP8_DOT=qa.is_cuda, num_warps=4, num_stages=4)
    return out
