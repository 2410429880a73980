"""Attention: store this step's K/V into the paged cache, then attend over each sequence's cache.

The layer owns no weights and knows no kernel: it holds the attention backend the engine picked at start-up
(models/layers/attention_backends) and hands it every step kind. Heads here are this rank's heads. The engine
binds `k_cache`/`v_cache` ([num_blocks, block_size, num_kv_heads, head_dim]) after allocating the KV pool;
before that (memory-profiling warm-up, fp8 scale calibration) the layer attends over just the new tokens, the
same for every backend. A float8_e4m3fn cache comes with `k_scale`/`v_scale` ([num_kv_heads] float32): K/V are
stored as x / scale and read back as fp8 * scale by every backend.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spmd_engine.models.attention_metadata import AttentionMetadata
from spmd_engine.models.layers.attention_backends import AttentionBackend, select_attention_backend
from spmd_engine.models.layers.attention_backends.base import CosSin, QKNorm


def use_attention_backend(model: nn.Module, backend: AttentionBackend) -> None:
    """Every attention layer of `model` attends with `backend` (the engine's start-up choice)."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.attention_backend = backend


class Attention(nn.Module):
    """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D] (causal, GQA, paged KV cache)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: str | AttentionBackend, window: int = 0) -> None:
        super().__init__()
        if window < 0:
            raise ValueError(f"attention window must be >= 0 (0: full attention), got {window}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.window = window  # a sliding window of this many positions (HF's `sliding_window`); 0: none
        # a name: the device-independent choice (no CUDA kernel) until the engine picks one for its device
        self.attention_backend = select_attention_backend(backend) if isinstance(backend, str) else backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None  # [num_kv_heads] float32, with a float8 cache only
        self.v_scale: torch.Tensor | None = None
        # [2, num_kv_heads] float32 while calibrating fp8 scales: the running max |K|, |V| per head
        self.kv_absmax: torch.Tensor | None = None

    @property
    def backend(self) -> str:
        """The `attention_backend` key this layer's backend serves ("torch" | "triton")."""
        return self.attention_backend.name

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """Store this step's K/V, then attend: `store` followed by `attend`."""
        self.store(k, v, attn)
        return self.attend(q, k, v, attn)

    def store(self, k: torch.Tensor, v: torch.Tensor, attn: AttentionMetadata) -> None:
        """Write the step's K/V into the cache at `attn.slot_mapping` (slot -1: not stored). Its launch
        depends only on shapes, so it runs inside CUDA graphs (the piecewise graphs capture it)."""
        num_tokens = k.shape[0]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.k_cache is not None:
            self.attention_backend.store(self, k, v, attn)
        elif self.kv_absmax is not None and num_tokens:
            seen = torch.stack([k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2))]).float()
            torch.maximum(self.kv_absmax, seen, out=self.kv_absmax)

    def rotate_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: CosSin,
                         attn: AttentionMetadata, qk_norm: QKNorm | None) -> torch.Tensor | None:
        """q/k per-head RMSNorm (`qk_norm` = (q weight, k weight, eps)), rotary on q and k and the K/V store in
        one launch -> the rotated q [T, Hq, D]. None where it does not apply (a backend without the fusion, no
        cache yet: warm-up, fp8 calibration): the caller then runs norm, rotary and `store` itself. Which one
        depends only on the layer and the shapes, so a captured graph always takes the same."""
        if self.k_cache is None:
            return None
        return self.attention_backend.rotate_and_store(self, q, k, v, cos_sin, attn, qk_norm)

    def rotate_store_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: CosSin,
                            attn: AttentionMetadata, qk_norm: QKNorm | None) -> torch.Tensor | None:
        """A decode step with a cache bound: `rotate_and_store` and `attend` as the backend does them in one go
        -> [T, Hq*D]. None where it does not apply: the caller then runs the two. Which one depends only on
        the layer, the cache dtype, the step kind and the shapes (graph-safe)."""
        if self.k_cache is None or not attn.is_decode:
            return None
        return self.attention_backend.decode(self, q, k, v, cos_sin, attn, qk_norm)

    def attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, attn: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq*D] -> [T, Hq*D] over the stored cache (written into `out` when given). k/v are read
        only before a cache is bound (warm-up, fp8 calibration: attention over the new tokens alone)."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        if self.k_cache is None:
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            result = self._attend_new_tokens_only(q, k, v, attn)
        else:
            result = self.attention_backend.attend(self, q, attn, None if out is None else out.view(q.shape))
        if out is None:
            return result.reshape(num_tokens, self.num_heads * self.head_dim)
        if result.data_ptr() != out.data_ptr():
            out.view(q.shape).copy_(result)
        return out

    def _attend_new_tokens_only(self, q, k, v, attn: AttentionMetadata) -> torch.Tensor:
        """Causal attention of each sequence over its own new tokens (no cache bound yet)."""
        out = torch.empty_like(q)
        group = self.num_heads // self.num_kv_heads
        bounds = attn.cu_seqlens_q.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end == start:
                continue
            qs = q[start:end].transpose(0, 1)  # [Hq, L, D]
            ks = k[start:end].transpose(0, 1).repeat_interleave(group, dim=0)
            vs = v[start:end].transpose(0, 1).repeat_interleave(group, dim=0)
            if self.window:
                pos = torch.arange(end - start, device=q.device)
                visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.window)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible, scale=self.scale)
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale)
            out[start:end] = o.transpose(0, 1)
        return out
