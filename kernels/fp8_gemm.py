"""Triton W8A8 GEMM with block scales: y[M, N] = sum over K steps of (qa . qw^T) * a_scale * w_scale (+ bias).

Operands (`kernels/reference.py`, FP8 section): qa float8_e4m3fn [M, K] with float32 scales [M, K / group]
(`kernels/fp8_act_quant.py`), qw float8_e4m3fn [N, K] with float32 scales [ceil(N / block_n),
ceil(K / block_k)]. Each program owns a BLOCK_M x BLOCK_N output tile and walks K in BLOCK_K steps; a step
lies inside one activation group and one weight block (BLOCK_K divides both, or they span all of K), so its
float32 partial product is scaled by one activation scale per row and one weight scale per column and added
to the float32 accumulator. The output is rounded once (to x's dtype, or kept float32 for a row-parallel
partial sum).

On CUDA the MMA takes the fp8 operands directly (sm_89+); `FP8_DOT=False` (the CPU interpreter, whose dot
has no fp8) upcasts them to float32 first, which gives the same products (an fp8 x fp8 product is exact in
float32). Per-token activations with per-channel weights go to cuBLASLt (`torch._scaled_mm`) instead where
it runs (`kernels/fp8_matmul.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count: nothing compiles mid-job
def _fp8_gemm_kernel(a, a_scale, w, w_scale, bias, out,
                     M, N, K, stride_am, stride_asm, stride_wn, stride_wsn, stride_om,
                     GROUP: tl.constexpr, BN_W: tl.constexpr, BK_W: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, FP8_DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_rows = a + rows.to(tl.int64)[:, None] * stride_am
    w_rows = w + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        qa = tl.load(a_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        qw = tl.load(w_rows + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if FP8_DOT:
            part = tl.dot(qa, tl.trans(qw))
        else:
            part = tl.dot(qa.to(tl.float32), tl.trans(qw.to(tl.float32)))
        sa = tl.load(a_scale + rows * stride_asm + k0 // GROUP, mask=row_ok, other=0.0)
        sw = tl.load(w_scale + (cols // BN_W) * stride_wsn + k0 // BK_W, mask=col_ok, other=0.0)
        acc += part * sa[:, None] * sw[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


MIN_K_STEP = 32  # an fp8 MMA's K


def k_step(k: int, group: int, block_k_w: int, most: int = 128) -> int:
    """The largest power-of-two K step <= `most` (>= MIN_K_STEP) inside one activation group and one weight block."""
    step = most
    while step > MIN_K_STEP and ((group % step and group < k) or (block_k_w % step and block_k_w < k)):
        step //= 2
    if (group < k and group % step) or (block_k_w < k and block_k_w % step):
        raise ValueError(f"fp8 matmul: activation group {group} and weight block {block_k_w} need a common "
                         f"power-of-two step >= {MIN_K_STEP}")
    return step


def fp8_gemm(qa: torch.Tensor, a_scale: torch.Tensor, group: int, qw: torch.Tensor, w_scale: torch.Tensor,
             block_n: int, block_k: int, bias: torch.Tensor | None, out_dtype: torch.dtype,
             config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """qa [M, K] fp8 + a_scale [M, K / group], qw [N, K] fp8 + w_scale [ceil(N / block_n), ceil(K / block_k)]
    -> [M, N] in `out_dtype` (summed in float32, rounded once)."""
    m, k = qa.shape
    n = qw.shape[0]
    config = config or Fp8GemmConfig()
    step = min(config.block_k, k_step(k, group, block_k))
    out = torch.empty(m, n, dtype=out_dtype, device=qa.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n))
    _fp8_gemm_kernel[grid](qa, a_scale, qw, w_scale, bias if bias is not None else out, out,
                           m, n, k, qa.stride(0), a_scale.stride(0), qw.stride(0), w_scale.stride(0), out.stride(0),
                           GROUP=group, BN_W=block_n, BK_W=block_k if block_k < k else k + step,
                           BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=step,
                           HAS_BIAS=bias is not None, FP8_DOT=qa.is_cuda,
                           num_warps=config.num_warps, num_stages=config.num_stages)
    return out
