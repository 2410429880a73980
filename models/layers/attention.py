"""Attention: store this step's K/V into the paged cache, then attend over each sequence's cache.

On the Triton path the store is fused with the q/k norm and rotary before it (`rotate_and_store`), and on
a decode step all of it runs inside the decode attention launch (`rotate_store_attend`); decode steps
attend with a CUDA kernel instead where one applies (`fp8_decode_cuda` for an fp8 cache, `decode_cuda` for a
bf16/fp16 one), which does the norm, rotary and store itself.

The layer owns no weights; it is the one place that knows the attention backends. Heads here are
this rank's heads. The engine binds `k_cache`/`v_cache` ([num_blocks, block_size, num_kv_heads,
head_dim]) after allocating the KV pool; before that (memory-profiling warm-up, fp8 scale
calibration) the layer attends over just the new tokens. A float8_e4m3fn cache comes with
`k_scale`/`v_scale` ([num_kv_heads] float32): K/V are stored as x / scale and read back as
fp8 * scale by every backend.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from spmd_engine.kernels.reference import paged_attention_reference, store_kv_reference
from spmd_engine.models.attention_metadata import AttentionMetadata

ATTENTION_BACKENDS = ("torch", "triton")
_mixed_attention = None  # spmd_engine.kernels.mixed_attention once the Triton path first runs
_rotary_decode = None  # spmd_engine.kernels.decode_rotary_attention, the same way
_fp8_cuda = None  # spmd_engine.kernels.decode_attention_fp8_cuda, the same way
_cuda16 = None  # spmd_engine.kernels.decode_attention_cuda, the same way
# A mixed prefill+decode step's decode rows attend with the cache's CUDA decode kernel (where it takes the
# shapes and its engine key is on), the prompt chunks with the Triton prefill kernel: two launches in place of
# the Triton mixed kernel, whose decode programs run at an estimated ~3 TB/s (the CUDA kernel: the copy rate;
# session 20: 205 us a layer for ~104 us of prompt tiles). Measured on an H200 (docs/BENCHMARKS.md, session 21):
# the bench 27,535-27,563 tok/s against 27,472-27,535 with the mixed kernel, alternating in one call (+0.1 %).
MIXED_DECODE_ON_CUDA = True


def set_fp8_decode_cuda(model: nn.Module, enabled: bool) -> None:
    """Engine key `cuda_fp8_decode`: fp8 decode steps attend with the CUDA kernel where it applies."""
    _set_on_attention_layers(model, "fp8_decode_cuda", enabled)


def set_decode_cuda(model: nn.Module, enabled: bool) -> None:
    """Engine key `cuda_decode`: bf16/fp16 caches' decode steps attend with the CUDA kernel where it applies."""
    _set_on_attention_layers(model, "decode_cuda", enabled)


def _set_on_attention_layers(model: nn.Module, flag: str, enabled: bool) -> None:
    for module in model.modules():
        if isinstance(module, Attention):
            setattr(module, flag, enabled)


class Attention(nn.Module):
    """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D] (causal, GQA, paged KV cache)."""

    fp8_decode_cuda: bool = True  # `set_fp8_decode_cuda` (engine key cuda_fp8_decode)
    decode_cuda: bool = True  # `set_decode_cuda` (engine key cuda_decode)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: str) -> None:
        super().__init__()
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None  # [num_kv_heads] float32, with a float8 cache only
        self.v_scale: torch.Tensor | None = None
        # [2, num_kv_heads] float32 while calibrating fp8 scales: the running max |K|, |V| per head
        self.kv_absmax: torch.Tensor | None = None

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
        if self.k_cache is None:
            if self.kv_absmax is not None and num_tokens:
                seen = torch.stack([k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2))]).float()
                torch.maximum(self.kv_absmax, seen, out=self.kv_absmax)
        elif self.backend == "torch":
            store_kv_reference(k, v, self.k_cache, self.v_cache, attn.slot_mapping, self.k_scale, self.v_scale)
        else:
            from spmd_engine.kernels.kv_store import store_kv

            store_kv(k, v, self.k_cache, self.v_cache, attn.slot_mapping, self.k_scale, self.v_scale)

    def rotate_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cos_sin: tuple[torch.Tensor, torch.Tensor],
                         attn: AttentionMetadata, qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None
                         ) -> torch.Tensor | None:
        """The Triton path with a cache bound: q/k per-head RMSNorm (`qk_norm` = (q weight, k weight, eps)),
        rotary on q and k and the K/V store in one launch (kernels/qk_norm_rope_store.py, the same bits
        as the separate kernels) -> the rotated q [T, Hq, D]. None where it does not apply (torch backend,
        no cache yet: warm-up, fp8 calibration): the caller then runs norm, rotary and `store` itself.
        Which one depends only on the layer and the shapes, so a captured graph always takes the same."""
        if self.backend != "triton" or self.k_cache is None:
            return None
        from spmd_engine.kernels.qk_norm_rope_store import can_fuse, qk_norm_rope_store

        num_tokens = q.shape[0]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not can_fuse(q, k, v, *cos_sin, qk_norm is not None):
            return None
        q_weight, k_weight, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
        q_out = attn.q_out.view(q.shape) if attn.q_out is not None else None
        return qk_norm_rope_store(q, k, v, *cos_sin, self.k_cache, self.v_cache, attn.slot_mapping, q_weight,
                                  k_weight, eps, self.k_scale, self.v_scale, q_out=q_out)

    def rotate_store_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cos_sin: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata,
                            qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None) -> torch.Tensor | None:
        """A decode step on the Triton path with a cache bound: `rotate_and_store` and `attend` in one launch
        (kernels/decode_rotary_attention.py: the decode kernel's programs norm and rotate their q/k and store
        the new K/V first; the same bits) -> [T, Hq*D]. None where it does not apply: the caller then runs
        the two. Which one depends only on the layer, the cache dtype (`ROTARY_IN_DECODE_CACHES`: where it was
        measured faster), the step kind and the shapes (graph-safe)."""
        global _rotary_decode
        if self.backend != "triton" or self.k_cache is None or not attn.is_decode:
            return None
        if _rotary_decode is None:
            from spmd_engine.kernels import decode_rotary_attention as _rotary_decode
        fp8 = self.k_cache.dtype == torch.float8_e4m3fn
        if self.fp8_decode_cuda if fp8 else self.decode_cuda:
            out = self._cuda_decode(q, k, v, cos_sin, attn, qk_norm, fp8)
            if out is not None:
                return out
        if self.k_cache.dtype not in _rotary_decode.ROTARY_IN_DECODE_CACHES:
            return None
        num_tokens = q.shape[0]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not _rotary_decode.can_rotate_in_decode(q, k, v, *cos_sin, qk_norm is not None, self.k_cache):
            return None
        q_weight, k_weight, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
        out = _rotary_decode.rotary_decode_attention(
            q, k, v, *cos_sin, self.k_cache, self.v_cache, attn.slot_mapping, attn.seq_lens, attn.block_tables,
            self.scale, q_weight=q_weight, k_weight=k_weight, eps=eps, k_scale=self.k_scale, v_scale=self.v_scale)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _cuda_decode(self, q, k, v, cos_sin, attn: AttentionMetadata, qk_norm, fp8: bool) -> torch.Tensor | None:
        """A decode step through a CUDA kernel (fp8 cache: kernels/decode_attention_fp8_cuda.py, 1.16x the
        engine's fp8 throughput over the Triton kernel; bf16/fp16 cache: kernels/decode_attention_cuda.py;
        docs/BENCHMARKS.md sessions 16-17): norm, rotary and the K/V store in one Triton launch, then
        attention -> [T, Hq*D]; either kernel does the norm, rotary and store itself where its
        `DecodePrologue` fits (`PREPARE_QK_IN_KERNEL`, one launch a layer fewer). None, having done nothing,
        where the kernel or the fused store does not take these shapes (the caller takes the Triton path)."""
        global _fp8_cuda, _cuda16
        if fp8:
            if _fp8_cuda is None:
                from spmd_engine.kernels import decode_attention_fp8_cuda as _fp8_cuda
            kernel, attend = _fp8_cuda, _fp8_cuda.paged_decode_attention_fp8
            scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        else:
            if _cuda16 is None:
                from spmd_engine.kernels import decode_attention_cuda as _cuda16
            kernel, attend, scales = _cuda16, _cuda16.paged_decode_attention_cuda, {}
        from spmd_engine.kernels.qk_norm_rope_store import can_fuse

        num_tokens = q.shape[0]
        heads = q.view(num_tokens, self.num_heads, self.head_dim)
        if not (kernel.supports(heads, self.k_cache, self.v_cache)
                and can_fuse(q, k, v.view(num_tokens, self.num_kv_heads, self.head_dim), *cos_sin,
                             qk_norm is not None)):
            return None
        if kernel.PREPARE_QK_IN_KERNEL:
            q_weight, k_weight, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
            prologue = kernel.DecodePrologue(k, v.view(num_tokens, self.num_kv_heads, self.head_dim), *cos_sin,
                                             attn.slot_mapping, q_weight, k_weight, eps)
            if prologue.fits(heads):
                out = attend(heads, self.k_cache, self.v_cache, attn.seq_lens, attn.block_tables, self.scale,
                             prologue=prologue, **scales)
                return out.view(num_tokens, self.num_heads * self.head_dim)
        rotated = self.rotate_and_store(q, k, v, cos_sin, attn, qk_norm).view(heads.shape)
        out = attend(rotated, self.k_cache, self.v_cache, attn.seq_lens, attn.block_tables, self.scale, **scales)
        return out.view(num_tokens, self.num_heads * self.head_dim)

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
        elif self.backend == "torch":
            result = paged_attention_reference(q, self.k_cache, self.v_cache, attn.cu_seqlens_q, attn.seq_lens,
                                               attn.block_tables, self.scale, self.k_scale, self.v_scale)
        else:
            result = self._triton_paged(q, attn, None if out is None else out.view(q.shape))
        if out is None:
            return result.reshape(num_tokens, self.num_heads * self.head_dim)
        if result.data_ptr() != out.data_ptr():
            out.view(q.shape).copy_(result)
        return out

    def _triton_paged(self, q: torch.Tensor, attn: AttentionMetadata, out: torch.Tensor | None) -> torch.Tensor:
        """The decode rows (query length 1, first in the batch) at split-KV decode-kernel efficiency, the
        prompt chunks after them at prefill efficiency (one launch for both with
        `mixed_attention.ONE_LAUNCH`): host ints only, no device sync. Everything the same for every layer of the step (checks, split count,
        configs, grids, partial buffers) is planned by the step's first layer and kept on `attn`."""
        global _mixed_attention
        if _mixed_attention is None:  # imported on first use (Triton), then a global: no import per layer
            from spmd_engine.kernels import mixed_attention as _mixed_attention
        plan_key, plan_paged_attention = _mixed_attention.plan_key, _mixed_attention.plan_paged_attention
        out = torch.empty_like(q) if out is None else out
        if q.stride(2) != 1:
            q = q.contiguous()
        key = plan_key(q, self.k_cache, out, self.k_scale is not None)
        plan = attn.launch_plans.get(key)
        decode_rows = self._mixed_decode_rows_on_cuda(q, attn)
        if plan is None:
            plan = attn.launch_plans[key] = plan_paged_attention(
                q, self.k_cache, self.v_cache, out, attn.cu_seqlens_q, attn.seq_lens, attn.block_tables,
                attn.num_decode_rows, attn.max_query_len, k_scale=self.k_scale, v_scale=self.v_scale,
                # a decode step may be a CUDA-graph capture after warm-up runs over the same metadata
                share_partials=not attn.is_decode, decode_rows_elsewhere=decode_rows is not None)
        if decode_rows is not None:
            n = attn.num_decode_rows
            decode_rows(q[:n], self.k_cache, self.v_cache, attn.seq_lens[:n], attn.block_tables[:n], self.scale,
                        out[:n])
        return plan.launch(q, self.k_cache, self.v_cache, out, self.scale, self.k_scale, self.v_scale)

    def _mixed_decode_rows_on_cuda(self, q: torch.Tensor, attn: AttentionMetadata):
        """A mixed step's decode rows (their K/V already stored) through this cache's CUDA decode kernel, as a
        decode step's are, rather than inside the Triton mixed kernel (`MIXED_DECODE_ON_CUDA`): the attend
        function (query, k_cache, v_cache, seq_lens, block_tables, scale, out), or None (the Triton plan
        takes them). Depends on the layer, the cache and the step's shape only, alike in every layer."""
        global _fp8_cuda, _cuda16
        n = attn.num_decode_rows
        if not MIXED_DECODE_ON_CUDA or attn.is_decode or not n or n >= attn.num_seqs or self.k_cache is None:
            return None
        if self.k_cache.dtype == torch.float8_e4m3fn:
            if not self.fp8_decode_cuda:
                return None
            if _fp8_cuda is None:
                from spmd_engine.kernels import decode_attention_fp8_cuda as _fp8_cuda
            kernel = _fp8_cuda
            attend = functools.partial(_fp8_cuda.paged_decode_attention_fp8, k_scale=self.k_scale,
                                       v_scale=self.v_scale)
        else:
            if not self.decode_cuda:
                return None
            if _cuda16 is None:
                from spmd_engine.kernels import decode_attention_cuda as _cuda16
            kernel, attend = _cuda16, _cuda16.paged_decode_attention_cuda
        return attend if kernel.supports(q[:n], self.k_cache, self.v_cache) else None

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
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale)
            out[start:end] = o.transpose(0, 1)
        return out
