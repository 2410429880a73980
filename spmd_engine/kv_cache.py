"""KV cache sizing and allocation: one tensor for all layers, viewed per layer as (K, V).

Sizing is the only place that depends on the device: a fixed `num_kv_blocks`, a GiB budget on
CPU, or what is left of `gpu_memory_utilization` after weights and the measured activation peak.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from models.model_config import ModelShape


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, shape: ModelShape, tp_size: int, block_size: int, dtype: torch.dtype) -> "KVCacheSpec":
        return cls(shape.num_layers, shape.kv_heads_per_rank(tp_size), shape.head_dim, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True)
class CudaMemoryBudget:
    """The numbers behind a CUDA KV sizing decision (logged, and quoted in errors).

    The eager activations of a step and the sampler's temporaries never live at the same time, so
    only the larger one is kept free; the CUDA graphs' memory pool stays allocated for good.
    """

    total: int
    utilization: float
    in_use: int  # weights, CUDA context, NCCL, other processes: total - free after the warm-up
    activation_peak: int  # extra bytes the warm-up forward at max_num_batched_tokens needed
    sampler_peak: int  # extra bytes sampling max_num_seqs rows needed (rank 0)
    graph_pool: int  # decode CUDA graphs: the warm-up decode forward's peak at the largest graph batch

    @property
    def kv_bytes(self) -> int:
        return (int(self.total * self.utilization) - self.in_use - max(self.activation_peak, self.sampler_peak)
                - self.graph_pool)

    def describe(self) -> str:
        gib = 1 << 30
        return (f"total {self.total / gib:.2f} GiB x gpu_memory_utilization {self.utilization} - in use "
                f"{self.in_use / gib:.2f} GiB - max(activation peak {self.activation_peak / gib:.2f}, sampler peak "
                f"{self.sampler_peak / gib:.2f}) GiB - CUDA graph pool {self.graph_pool / gib:.2f} GiB = "
                f"{self.kv_bytes / gib:.2f} GiB for KV")


def blocks_for_bytes(spec: KVCacheSpec, num_bytes: float) -> int:
    return max(0, int(num_bytes // spec.bytes_per_block))


def planned_num_blocks(spec: KVCacheSpec, num_kv_blocks: int | None, cpu_kv_cache_gib: float,
                       device: torch.device) -> int | None:
    """The pool size known without running the model: fixed, or the CPU budget; None on CUDA (measured)."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    if device.type != "cuda":
        return blocks_for_bytes(spec, cpu_kv_cache_gib * (1 << 30))
    return None


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = torch.empty(spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim,
                        dtype=spec.dtype, device=device)
    return [(cache[i, 0], cache[i, 1]) for i in range(spec.num_layers)]
