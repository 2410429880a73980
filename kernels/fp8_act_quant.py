"""Triton dynamic FP8 activation quantization: x [M, K] -> float8_e4m3fn [M, K] and float32 scales
[M, K / group], one per token and group of `group` columns (group = K: one per token).

The scale is a power of two, 2^ceil(log2 amax) / 256 (`reference.fp8_act_scale_reference`), so x / scale is
exact and the only rounding is to e4m3. That rounding is done here in float32 arithmetic (round to nearest
even on the e4m3 grid, then an exact cast), not by the float8 cast itself: the CPU interpreter's cast rounds
some values wrongly, and the explicit rounding gives the reference's bytes on both. `gated`: x holds a
SwiGLU's gate | up ([M, 2K]) and the quantized input is silu(gate) * up rounded to x's dtype (the bits of
`kernels/silu_and_mul.py`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.reference import FP8_ACT_HEADROOM, FP8_E4M3_MAX, FP8_MIN_AMAX
from spmd_engine.kernels.silu_and_mul import silu_mul

ROUND_MAGIC = 12582912.0  # 1.5 * 2^23: (t + it) - it rounds |t| < 2^22 to an integer, ties to even


@triton.jit
def round_to_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest float8_e4m3fn value (ties to even), still float32."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # below 2^-6 the e4m3 grid is subnormal: steps of 2^-9
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    t = tl.abs(v) / step  # a power of two: exact
    t = (t + ROUND_MAGIC) - ROUND_MAGIC
    magnitude = (t * step).to(tl.int32, bitcast=True)
    return (magnitude | (bits & -2147483648)).to(tl.float32, bitcast=True)  # the sign kept (also of a zero)


@triton.jit
def pow2_scale(amax):
    """2^ceil(log2 amax) / HEADROOM for float32 amax >= FP8_MIN_AMAX, and its reciprocal (both exact)."""
    bits = amax.to(tl.int32, bitcast=True)
    biased = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # the power of two >= amax
    scale = ((biased - 8) << 23).to(tl.float32, bitcast=True)  # / 256
    inverse = ((254 - (biased - 8)) << 23).to(tl.float32, bitcast=True)
    return scale, inverse


@triton.jit
def _act_quant_kernel(x, q, s, K, stride_xm, stride_qm, stride_sm, groups,
                      GROUP: tl.constexpr, BLOCK: tl.constexpr, GATED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < GROUP
    if GATED:
        gate = tl.load(x + row * stride_xm + cols, mask=mask, other=0.0)
        up = tl.load(x + row * stride_xm + K + cols, mask=mask, other=0.0)
        v = silu_mul(gate, up, x.dtype.element_ty).to(tl.float32)
    else:
        v = tl.load(x + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(v), axis=0), FP8_MIN_AMAX)
    scale, inverse = pow2_scale(amax)
    r = round_to_e4m3(tl.minimum(tl.maximum(v * inverse, -FP8_E4M3_MAX), FP8_E4M3_MAX))
    tl.store(q + row * stride_qm + cols, r.to(q.dtype.element_ty), mask=mask)
    tl.store(s + row * stride_sm + g, scale)


def fp8_act_quant(x: torch.Tensor, group: int, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (gated: [M, 2K]), last dim contiguous -> (float8_e4m3fn [M, K], float32 [M, K / group])."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"fp8_act_quant: x must be 2-D with a contiguous last dim, got {tuple(x.shape)}")
    m, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    if k % group:
        raise ValueError(f"fp8_act_quant: K={k} is not a multiple of the group {group}")
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, k // group, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(group)
        _act_quant_kernel[(m, k // group)](x, q, s, k, x.stride(0), q.stride(0), s.stride(0), k // group,
                                          GROUP=group, BLOCK=block, GATED=gated,
                                          num_warps=4 if block <= 2048 else 8)
    return q, s


assert FP8_ACT_HEADROOM == 256.0  # pow2_scale divides by 2^8
