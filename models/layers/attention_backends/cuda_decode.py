"""The Triton backend with decode attention on a CUDA C++ kernel (kernels/decode_attention_cuda.py for a
bf16/fp16 cache, kernels/decode_attention_fp8_cuda.py for an fp8 one), where the kernel takes the shapes.

Why: the fp8 kernel gives 1.16x the engine's fp8 throughput over the Triton decode kernel, the 16-bit one 3 %
on the nano bench (H200, `python run.py workload=bench`; their module docs). A decode step hands the kernel the
qkv projection's raw rows (`DecodePrologue`): it norms, rotates and stores them itself, one launch a layer
fewer. A mixed step's decode rows attend with the same kernel and the prompt chunks with the Triton prefill
kernel: two launches in place of the Triton mixed kernel, whose decode programs run at an estimated ~3 TB/s
(the CUDA kernel: the copy rate). H200, `python run.py workload=bench`: 27,535-27,563 tok/s against
27,472-27,535 with the mixed kernel, alternating in one run (+0.1 %).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from spmd_engine.models.attention_metadata import AttentionMetadata
from spmd_engine.models.layers.attention_backends.base import AttentionLayer, CosSin, QKNorm
from spmd_engine.models.layers.attention_backends.triton import DecodeRows, TritonAttentionBackend


@dataclass(frozen=True)
class CudaDecodeKernel:
    """One CUDA decode kernel module: `supports(query, k_cache, v_cache)`, `DecodePrologue`, and its attend
    function `attend_name` (query, k_cache, v_cache, seq_lens, block_tables, scale, out, *, prologue[, scales])."""

    module: Any
    attend_name: str
    takes_scales: bool  # an fp8 cache's kernel: k_scale / v_scale keywords

    @classmethod
    def for_16_bit_cache(cls) -> CudaDecodeKernel:
        from spmd_engine.kernels import decode_attention_cuda

        return cls(decode_attention_cuda, "paged_decode_attention_cuda", takes_scales=False)

    @classmethod
    def for_fp8_cache(cls) -> CudaDecodeKernel:
        from spmd_engine.kernels import decode_attention_fp8_cuda

        return cls(decode_attention_fp8_cuda, "paged_decode_attention_fp8", takes_scales=True)

    def attend_function(self, layer: AttentionLayer) -> DecodeRows:
        attend = getattr(self.module, self.attend_name)
        if self.takes_scales:
            return functools.partial(attend, k_scale=layer.k_scale, v_scale=layer.v_scale)
        return attend


class CudaDecodeAttentionBackend(TritonAttentionBackend):
    """Triton for everything but decode rows, which go to `kernel` where it takes them."""

    def __init__(self, kernel: CudaDecodeKernel) -> None:
        super().__init__()
        self.kernel = kernel

    def decode(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: CosSin,
               attn: AttentionMetadata, qk_norm: QKNorm | None) -> torch.Tensor | None:
        out = self._cuda_decode(layer, q, k, v, cos_sin, attn, qk_norm)
        return out if out is not None else super().decode(layer, q, k, v, cos_sin, attn, qk_norm)

    def _cuda_decode(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cos_sin: CosSin, attn: AttentionMetadata, qk_norm: QKNorm | None) -> torch.Tensor | None:
        """Norm, rotary, the K/V store and attention in the kernel where its `DecodePrologue` fits, else the
        fused store launch, then the kernel -> [T, Hq*D]. None, having done nothing, where the kernel or the
        fused store does not take these shapes, or for a sliding-window layer (the Triton kernels take it)."""
        if layer.window:
            return None
        num_tokens = q.shape[0]
        heads = q.view(num_tokens, layer.num_heads, layer.head_dim)
        v_heads = v.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        if not (self.kernel.module.supports(heads, layer.k_cache, layer.v_cache)
                and self.qk_norm_rope_store.can_fuse(q, k, v_heads, *cos_sin, qk_norm is not None)):
            return None
        attend = self.kernel.attend_function(layer)
        q_weight, k_weight, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
        prologue = self.kernel.module.DecodePrologue(k, v_heads, *cos_sin, attn.slot_mapping, q_weight, k_weight, eps)
        if prologue.fits(heads):
            out = attend(heads, layer.k_cache, layer.v_cache, attn.seq_lens, attn.block_tables, layer.scale,
                         prologue=prologue)
        else:
            rotated = self.rotate_and_store(layer, q, k, v, cos_sin, attn, qk_norm).view(heads.shape)
            out = attend(rotated, layer.k_cache, layer.v_cache, attn.seq_lens, attn.block_tables, layer.scale)
        return out.view(num_tokens, layer.num_heads * layer.head_dim)

    def mixed_decode_rows(self, layer: AttentionLayer, q: torch.Tensor, attn: AttentionMetadata) -> DecodeRows | None:
        """A mixed step's decode rows through the kernel, as a decode step's are, where it takes them. Depends on
        the layer, the cache and the step's shape only, alike in every layer."""
        n = attn.num_decode_rows
        if attn.is_decode or not n or n >= attn.num_seqs or layer.window:
            return None
        return self.kernel.attend_function(layer) if self.kernel.module.supports(q[:n], layer.k_cache,
                                                                                  layer.v_cache) else None
