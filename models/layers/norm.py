"""RMSNorm, optionally fused with the residual add that precedes every norm in a decoder layer.

On CUDA one Triton launch does add + norm (`kernels/rms_norm.py`); elsewhere the torch ops below.
"""
from __future__ import annotations

import torch
from torch import nn

from spmd_engine.models.layers.weight_loading import new_parameter


class RMSNorm(nn.Module):
    """y = w * x / rms(x), computed in float32 and cast back, as in HF Llama/Qwen3."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter(hidden_size)
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`; with `residual`: `(norm(x + residual), x + residual)`. On CUDA the sum goes over
        `residual` itself where it is contiguous (the stream is read once per layer, never again): no new
        tensor, and the piecewise graphs' static residual buffer stays where the next piece reads it."""
        if x.is_cuda and x.dim() in (2, 3) and x.stride(-1) == 1:
            from spmd_engine.kernels.rms_norm import rms_norm

            in_place = residual is not None and residual.is_contiguous()
            return rms_norm(x, self.weight, self.eps, residual, residual if in_place else None)
        if residual is not None:
            x = x + residual
            return self._normalize(x), x
        return self._normalize(x)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
