"""How a parameter takes its share of a FULL checkpoint tensor.

Every parameter carries a `weight_loader(param, full_tensor[, shard_id])`; the loader module only
maps checkpoint names to parameters and never needs to know how a layer is sharded.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

WeightLoader = Callable[..., None]


def attach_loader(param: nn.Parameter, loader: WeightLoader) -> nn.Parameter:
    param.weight_loader = loader
    return param


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """Copy `src` into `dst` (casting dtype/device) after checking the shapes agree."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shard has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def replicated_loader(param: nn.Parameter, full: torch.Tensor) -> None:
    """Every rank holds the whole tensor (norm weights, row-parallel biases)."""
    copy_checked(param.data, full, "replicated weight")


def new_parameter(*shape: int, loader: WeightLoader = replicated_loader) -> nn.Parameter:
    """An uninitialised parameter on the caller's default device/dtype, with its loader attached."""
    return attach_loader(nn.Parameter(torch.empty(*shape), requires_grad=False), loader)
