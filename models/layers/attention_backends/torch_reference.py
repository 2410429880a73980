"""The plain-torch backend (`attention_backend=torch`): the reference every kernel is checked against, and
the CPU path."""
from __future__ import annotations

import torch

from spmd_engine.kernels.reference import (paged_attention_int8_reference, paged_attention_reference,
                                          store_kv_int8_reference, store_kv_reference)
from spmd_engine.models.attention_metadata import AttentionMetadata
from spmd_engine.models.layers.attention_backends.base import AttentionBackend, AttentionLayer


class TorchAttentionBackend(AttentionBackend):
    """Store and attend with kernels/reference.py: one gather per sequence, no fusion."""

    name = "torch"

    def store(self, layer: AttentionLayer, k: torch.Tensor, v: torch.Tensor, attn: AttentionMetadata) -> None:
        if layer.k_cache.dtype == torch.int8:  # kv_cache_dtype=int8 (kernels/reference.py, int8 KV cache)
            store_kv_int8_reference(k, v, layer.k_cache, layer.v_cache, attn.slot_mapping)
            return
        store_kv_reference(k, v, layer.k_cache, layer.v_cache, attn.slot_mapping, layer.k_scale, layer.v_scale)

    def attend(self, layer: AttentionLayer, q: torch.Tensor, attn: AttentionMetadata,
               out: torch.Tensor | None) -> torch.Tensor:
        if layer.k_cache.dtype == torch.int8:
            return paged_attention_int8_reference(q, layer.k_cache, layer.v_cache, attn.cu_seqlens_q, attn.seq_lens,
                                                  attn.block_tables, layer.scale, window=layer.window)
        return paged_attention_reference(q, layer.k_cache, layer.v_cache, attn.cu_seqlens_q, attn.seq_lens,
                                         attn.block_tables, layer.scale, layer.k_scale, layer.v_scale,
                                         window=layer.window)
