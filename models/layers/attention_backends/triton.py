"""The Triton backend (`attention_backend=triton`): fused q/k norm + rotary + K/V store, decode attention with
the same fusion inside its launch, and one planned launch per layer for prefill and mixed steps.

The store is fused with the q/k norm and rotary before it (kernels/qk_norm_rope_store.py), and on a decode
step over a cache named in `ROTARY_IN_DECODE_CACHES` (where it was measured faster) all of it runs inside the
decode attention launch (kernels/decode_rotary_attention.py). Prefill and mixed steps run the step's plan
(kernels/mixed_attention.py): the decode rows at split-KV decode-kernel efficiency, the prompt chunks at
prefill efficiency, one launch for both.

An int8 cache (`kv_cache_dtype=int8`, kernels/kv_int8.py): the store rotates and quantizes (no fused store or
rotary decode), and `attend` rotates q before the planned launch and its float32 output back after it.
"""
from __future__ import annotations

from typing import Callable

import torch

from spmd_engine.models.attention_metadata import AttentionMetadata
from spmd_engine.models.layers.attention_backends.base import AttentionBackend, AttentionLayer, CosSin, QKNorm

# (query, k_cache, v_cache, seq_lens, block_tables, scale, out) -> out: a mixed step's decode rows elsewhere
DecodeRows = Callable[..., torch.Tensor]


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels; a subclass may take decode rows elsewhere (`decode`, `mixed_decode_rows`)."""

    name = "triton"

    def __init__(self) -> None:
        # modules, not functions: a kernel is looked up at each call (tests count launches by replacing it)
        from spmd_engine.kernels import decode_rotary_attention, kv_int8, kv_store, mixed_attention, qk_norm_rope_store

        self.kv_store, self.mixed_attention, self.kv_int8 = kv_store, mixed_attention, kv_int8
        self.qk_norm_rope_store, self.rotary_decode = qk_norm_rope_store, decode_rotary_attention

    def store(self, layer: AttentionLayer, k: torch.Tensor, v: torch.Tensor, attn: AttentionMetadata) -> None:
        if layer.k_cache.dtype == torch.int8:
            self.kv_int8.store_kv_int8(k, v, layer.k_cache, layer.v_cache, attn.slot_mapping)
            return
        self.kv_store.store_kv(k, v, layer.k_cache, layer.v_cache, attn.slot_mapping, layer.k_scale, layer.v_scale)

    def rotate_and_store(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cos_sin: CosSin, attn: AttentionMetadata, qk_norm: QKNorm | None) -> torch.Tensor | None:
        """kernels/qk_norm_rope_store.py: the same bits as the separate kernels; None where it does not fuse."""
        fused = self.qk_norm_rope_store
        if layer.k_cache.dtype == torch.int8:
            return None
        v = v.view(q.shape[0], layer.num_kv_heads, layer.head_dim)
        if not fused.can_fuse(q, k, v, *cos_sin, qk_norm is not None):
            return None
        q_weight, k_weight, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
        q_out = attn.q_out.view(q.shape) if attn.q_out is not None else None
        return fused.qk_norm_rope_store(q, k, v, *cos_sin, layer.k_cache, layer.v_cache, attn.slot_mapping, q_weight,
                                        k_weight, eps, layer.k_scale, layer.v_scale, q_out=q_out)

    def decode(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: CosSin,
               attn: AttentionMetadata, qk_norm: QKNorm | None) -> torch.Tensor | None:
        """kernels/decode_rotary_attention.py (the decode kernel's programs norm and rotate their q/k and store
        the new K/V first; the same bits) on the caches `ROTARY_IN_DECODE_CACHES` names."""
        rotary = self.rotary_decode
        if layer.window or layer.k_cache.dtype not in rotary.ROTARY_IN_DECODE_CACHES:
            return None  # a sliding layer's decode runs the planned kernels (`attend`)
        num_tokens = q.shape[0]
        v = v.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        if not rotary.can_rotate_in_decode(q, k, v, *cos_sin, qk_norm is not None, layer.k_cache):
            return None
        q_weight, k_weight, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
        out = rotary.rotary_decode_attention(
            q, k, v, *cos_sin, layer.k_cache, layer.v_cache, attn.slot_mapping, attn.seq_lens, attn.block_tables,
            layer.scale, q_weight=q_weight, k_weight=k_weight, eps=eps, k_scale=layer.k_scale, v_scale=layer.v_scale)
        return out.view(num_tokens, layer.num_heads * layer.head_dim)

    def attend(self, layer: AttentionLayer, q: torch.Tensor, attn: AttentionMetadata,
               out: torch.Tensor | None) -> torch.Tensor:
        """The step's plan (kernels/mixed_attention.py), host ints only, no device sync. Everything the same for
        every layer of the step (checks, split count, configs, grids, partial buffers) is planned by the step's
        first layer and kept on `attn`."""
        out = torch.empty_like(q) if out is None else out
        if q.stride(2) != 1:
            q = q.contiguous()
        if layer.k_cache.dtype == torch.int8:  # the kernels attend in the cache's rotated basis
            rotated_out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
            self._attend_planned(layer, self.kv_int8.rotate_rows(q), attn, rotated_out)
            return self.kv_int8.rotate_rows(rotated_out, out=out)
        return self._attend_planned(layer, q, attn, out)

    def _attend_planned(self, layer: AttentionLayer, q: torch.Tensor, attn: AttentionMetadata,
                        out: torch.Tensor) -> torch.Tensor:
        mixed = self.mixed_attention
        key = mixed.plan_key(q, layer.k_cache, out, layer.k_scale is not None, layer.window)
        plan = attn.launch_plans.get(key)
        decode_rows = self.mixed_decode_rows(layer, q, attn)
        if plan is None:
            plan = attn.launch_plans[key] = mixed.plan_paged_attention(
                q, layer.k_cache, layer.v_cache, out, attn.cu_seqlens_q, attn.seq_lens, attn.block_tables,
                attn.num_decode_rows, attn.max_query_len, k_scale=layer.k_scale, v_scale=layer.v_scale,
                # a decode step may be a CUDA-graph capture after warm-up runs over the same metadata
                share_partials=not attn.is_decode, decode_rows_elsewhere=decode_rows is not None,
                window=layer.window)
        if decode_rows is not None:
            n = attn.num_decode_rows
            decode_rows(q[:n], layer.k_cache, layer.v_cache, attn.seq_lens[:n], attn.block_tables[:n], layer.scale,
                        out[:n])
        return plan.launch(q, layer.k_cache, layer.v_cache, out, layer.scale, layer.k_scale, layer.v_scale)

    def mixed_decode_rows(self, layer: AttentionLayer, q: torch.Tensor, attn: AttentionMetadata) -> DecodeRows | None:
        """A mixed step's decode rows through another kernel (their K/V already stored): its attend function,
        or None (the Triton plan takes them). Here always None."""
        return None
