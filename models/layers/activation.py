"""SiluAndMul: the gated activation of a SwiGLU MLP whose gate and up projections are packed.

On CUDA one Triton launch (`kernels/silu_and_mul.py`) replaces silu + mul.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[..., 2d] (gate | up) -> [..., d] = silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2 and x.stride(1) == 1:
            from spmd_engine.kernels.silu_and_mul import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
