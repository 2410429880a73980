"""SiluAndMul: the gated activation of a SwiGLU MLP whose gate and up projections are packed.

On CUDA one Triton launch (`kernels/silu_and_mul.py`) replaces silu + mul; at small batch the down
projection's GEMV computes it while loading its input (`linear(..., gated=True)`): no launch at all.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] (gate | up) -> [..., d] = silu(gate) * up."""
    if x.is_cuda and x.dim() == 2 and x.stride(1) == 1:
        from spmd_engine.kernels.silu_and_mul import silu_and_mul as silu_and_mul_kernel

        return silu_and_mul_kernel(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """[..., 2d] (gate | up) -> [..., d] = silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
