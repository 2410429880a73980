"""The interface every attention backend implements: how one layer stores K/V and attends over its paged cache.

Why: the engine picks a backend once at start-up (`select_attention_backend`); a layer then calls it for every
step kind (prefill, decode, mixed) without asking which one it holds. A new attention shape (a sliding window,
say) changes this interface and each backend, not an if-chain in the layer. A backend holds no per-layer state:
the layer (`AttentionLayer`) carries its heads, scale and bound cache, so one backend object serves every layer.
Every method runs only with a cache bound; before that (warm-up, fp8 calibration) the layer attends over the
new tokens itself.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch

from spmd_engine.models.attention_metadata import AttentionMetadata

CosSin = tuple[torch.Tensor, torch.Tensor]
QKNorm = tuple[torch.Tensor, torch.Tensor, float]  # (q weight, k weight, eps) of a per-head RMSNorm


class AttentionLayer(Protocol):
    """What a backend reads from the layer it serves (models/layers/attention.Attention)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window: int  # sliding window: each query sees its last `window` positions; 0 = every earlier position
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None  # [num_kv_heads] float32, with a float8 cache only
    v_scale: torch.Tensor | None


class AttentionBackend(ABC):
    """One way of storing and attending; `name` is the `attention_backend` key it serves."""

    name: str

    @abstractmethod
    def store(self, layer: AttentionLayer, k: torch.Tensor, v: torch.Tensor, attn: AttentionMetadata) -> None:
        """Write k, v [T, Hkv, D] into the cache at `attn.slot_mapping` (slot -1: not stored)."""

    @abstractmethod
    def attend(self, layer: AttentionLayer, q: torch.Tensor, attn: AttentionMetadata,
               out: torch.Tensor | None) -> torch.Tensor:
        """q [T, Hq, D] over the stored cache -> [T, Hq, D] (into `out` [T, Hq, D] where the backend can)."""

    def rotate_and_store(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cos_sin: CosSin, attn: AttentionMetadata, qk_norm: QKNorm | None) -> torch.Tensor | None:
        """q/k norm, rotary and the K/V store in one launch -> the rotated q [T, Hq, D]; None where this backend
        does not fuse them (the layer then runs norm, rotary and `store` itself)."""
        return None

    def decode(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: CosSin,
               attn: AttentionMetadata, qk_norm: QKNorm | None) -> torch.Tensor | None:
        """A decode step from the qkv projection's raw rows to attention's output [T, Hq*D]; None, having done
        nothing, where the backend does not take these shapes (the layer then rotates, stores and attends).
        The answer depends only on the layer, the cache dtype and the shapes, so a captured graph replays it."""
        return None
