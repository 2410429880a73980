"""TensorParallel: which shard this rank holds and the two collectives the layers need.

Layers get one of these from whoever builds them (no global process-group state), so the same
layer code runs unsharded (world size 1: no collectives at all) or sharded over a process group.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class TensorParallel:
    """Position of this process inside its tensor-parallel group (group=None: the default group).

    `reduce_dtype`: the dtype in which row-parallel layers sum their partial products. None sums
    in the activation dtype; float32 rounds a bf16/fp16 result once, after the sum, as one rank
    does, instead of once per rank and again after the sum (see RowParallelLinear).

    `reduce`: the engine's all-reduce for this group (spmd_engine/executor/tp_allreduce.py: NCCL or
    symmetric memory, chosen at start-up); None: `dist.all_reduce` over `group`. Injected, so the
    layers keep one call site whatever sums their partials.
    """

    rank: int
    world_size: int
    group: ProcessGroup | None = None
    reduce_dtype: torch.dtype | None = None
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"tensor-parallel rank must be in [0, {self.world_size}), got {self.rank}")
        if self.reduce_dtype not in (None, torch.float32):
            raise ValueError(f"tensor-parallel reduce_dtype must be None or torch.float32, got {self.reduce_dtype}")

    @classmethod
    def single(cls) -> TensorParallel:
        return cls(rank=0, world_size=1, group=None)

    @classmethod
    def from_default_group(cls, reduce_dtype: torch.dtype | None = None) -> TensorParallel:
        """Every rank of the initialised default process group in one tensor-parallel group."""
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), group=None, reduce_dtype=reduce_dtype)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group; returns the sum: `x` summed in place, or a new tensor (symmetric
        memory), so callers use the return value."""
        if self.world_size == 1:
            return x
        if self.reduce is not None:
            return self.reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def gather_to_first(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        """Concatenate every rank's `x` along `dim` on group rank 0; None on the other ranks."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        if x.is_cuda:
            # NCCL has no gather (torch builds one from send/recv); an all-gather is one collective
            # that CUDA graphs capture like the all-reduces. The other ranks drop the result.
            full = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(full, x, group=self.group)
            return torch.cat(full.unbind(0), dim=dim) if self.is_first else None
        first = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(x, gather_list=parts, dst=first, group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None
