"""The W8A8 matmul's dispatch: one call, `fp8_linear`, picks the path for the device and the batch.

- CPU: the plain-torch reference (`reference.fp8_linear_reference`: quantized activations times the
  dequantized weight in float32), so CI runs the same math as the GPU; the dequantized weight is kept
  between calls (until the weight or its scales change).
- CUDA: activations quantized per (token, group) by `kernels/fp8_act_quant.py`, then
  - M <= 16 rows (decode at small batch): the Triton GEMV (`kernels/fp8_gemv.py`), reading fp8 weights once;
    with activation groups of 32..128 columns it quantizes the activations itself (one launch, the same bits);
  - per-token activation scales with per-output-channel weight scales and a bf16 output: cuBLASLt
    (`torch._scaled_mm`, row-wise scaling) where it runs on this GPU (probed once, eagerly);
  - anything else (block-scaled weights, float32 partial sums): the Triton block-scaled GEMM
    (`kernels/fp8_gemm.py`).
"""
from __future__ import annotations

import functools

import torch

from spmd_engine.kernels.reference import fp8_dequantize_weight_reference, fp8_linear_reference

SMALL_BATCH_MAX_M = 16


@functools.cache
def scaled_mm_rowwise_works(device_index: int) -> bool:
    """Whether torch._scaled_mm runs row-wise scaled fp8 x fp8 -> bf16 on this GPU (sm_89+ and a torch that
    has it); tried once on tiny operands, outside any CUDA-graph capture."""
    if torch.cuda.get_device_capability(device_index) < (8, 9) or not hasattr(torch, "_scaled_mm"):
        return False
    device = torch.device("cuda", device_index)
    try:
        a = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
        b = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(a, b.t(), scale_a=torch.ones(16, 1, device=device),
                             scale_b=torch.ones(1, 16, device=device), out_dtype=torch.bfloat16)
        return bool((y.float() == 32).all())
    except (RuntimeError, TypeError, ValueError):
        return False


def _dequantized_on_cpu(weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """The float32 weight the CPU path multiplies by, kept on the weight until the weight or its scales change
    in place (their version counters): CPU runs test the math, and converting fp8 per call is slow there."""
    key = (weight._version, scale._version, weight.data_ptr(), scale.data_ptr())
    cached = getattr(weight, "_fp8_dequantized", None)
    if cached is None or cached[0] != key:
        cached = (key, fp8_dequantize_weight_reference(weight, scale, block_n, block_k))
        weight._fp8_dequantized = cached
    return cached[1]


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int, group: int,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, gated: bool = False
               ) -> torch.Tensor:
    """x [..., K] (gated: [..., 2K]) @ dequant(weight [N, K])^T (+ bias) with x quantized per (token, group of
    `group` columns); float32 sums rounded once to `out_dtype` (None: x's dtype)."""
    out_dtype = out_dtype or x.dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not x.is_cuda:
        dequantized = _dequantized_on_cpu(weight, scale, block_n, block_k)
        y = fp8_linear_reference(x2, weight, scale, block_n, block_k, group, bias, out_dtype, gated,
                                 dequantized=dequantized)
        return y.view(*lead, weight.shape[0])
    from spmd_engine.kernels.fp8_act_quant import fp8_act_quant
    from spmd_engine.kernels.fp8_gemv import fp8_gemv_fused, fusable

    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = weight.shape[0]
    if x2.shape[0] <= SMALL_BATCH_MAX_M and fusable(weight.shape[1], group, block_k):
        y = fp8_gemv_fused(x2, group, weight, scale, block_n, block_k, bias, out_dtype, gated)
        return y.view(*lead, n)
    qa, a_scale = fp8_act_quant(x2, group, gated)
    m, k = qa.shape
    if m <= SMALL_BATCH_MAX_M:
        from spmd_engine.kernels.fp8_gemv import fp8_gemv

        y = fp8_gemv(qa, a_scale, group, weight, scale, block_n, block_k, bias, out_dtype)
    elif (group == k and block_n == 1 and block_k >= k and out_dtype == torch.bfloat16 and k % 16 == 0
          and n % 16 == 0 and scaled_mm_rowwise_works(x.device.index or 0)):
        y = torch._scaled_mm(qa, weight.t(), scale_a=a_scale, scale_b=scale.view(1, n), out_dtype=out_dtype,
                             bias=None if bias is None else bias.to(out_dtype))
    else:
        from spmd_engine.kernels.fp8_gemm import fp8_gemm

        y = fp8_gemm(qa, a_scale, group, weight, scale, block_n, block_k, bias, out_dtype)
    return y.view(*lead, n)
