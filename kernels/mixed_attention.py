"""One step's paged attention, planned once and launched per layer: decode rows and prompt chunks.

A step's batch (the first `num_decode` sequences have one query row each, the prompt chunks follow)
has the same layout in every layer: what the launches need besides the layer's own q/K/V/out
pointers (validated shapes, the decode split count and tile config, the float32 split partials, the
grids, strides and compile-time constants) is computed once per step by `plan_paged_attention` and
reused by every layer's `PagedAttentionPlan.launch`, which does only the kernel launches.

A mixed batch runs as ONE launch per layer (`_mixed_paged_attention_kernel`): a 1-D grid whose first
programs are the prefill kernel's (query tile, query head, prompt sequence) programs and whose last
are the decode kernel's (decode sequence, KV head, split) programs, each running the very same
program body as its own kernel (`prefill_program`, `decode_split_program`), so every output row has
the bits of the two-kernel path. Decode rows keep decode-kernel efficiency (one query row per
sequence, GQA heads packed, split-KV); with more than one split the last split to arrive merges
them, as on the decode path. The grid depends on the host ints of the step only; the kernel reads
the whole (unsliced) metadata tensors and offsets by `num_decode` on the device, so no pointer it
gets depends on the batch composition (Triton specialises pointers on 16-byte alignment), and the
data-dependent ints, the split count among them, are runtime arguments Triton does not specialise
on: one compiled kernel serves every batch composition, so none is compiled in the middle of a job.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.attention_support import check_attention_inputs, dot_precision, is_int8_cache
from spmd_engine.kernels.decode_attention import (
    DecodeConfig,
    _decode_any_splits_kernel,
    _decode_split_kernel,
    decode_block_h,
    decode_split_program,
    default_decode_config,
    merge_counters,
    split_count,
)
from spmd_engine.kernels.kv_quant import check_kv_scales
from spmd_engine.kernels.paged_kv_tile import fp8_dot_in_f16
from spmd_engine.kernels.pdl import pdl_launch, pdl_prologue
from spmd_engine.kernels.prefill_attention import (
    PrefillConfig,
    _paged_prefill_kernel,
    default_prefill_config,
    prefill_program,
)

_LOG2_E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_decode", "num_q_tiles", "prefill_programs", "num_splits"])
def _mixed_paged_attention_kernel(
    query, k_cache, v_cache, out, partial_out, partial_lse, counters, cu_seqlens_q, seq_lens, block_tables,
    scale_log2, k_scale, v_scale,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_cache_block, stride_cache_pos, stride_cache_head, stride_table,
    num_q_heads, num_decode, num_q_tiles, prefill_programs, num_splits,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    DECODE_BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, DOT_F16: tl.constexpr,
    USE_PDL: tl.constexpr, WINDOW: tl.constexpr = 0, KV_INT8: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    pid = tl.program_id(0)
    if pid < prefill_programs:  # the prefill grid (q_tile fastest, reversed: longest causal rows first)
        q_tile = num_q_tiles - 1 - pid % num_q_tiles
        rest = pid // num_q_tiles
        prefill_program(
            q_tile, rest % num_q_heads, num_decode + rest // num_q_heads,
            query, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, scale_log2, k_scale, v_scale,
            stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
            stride_cache_block, stride_cache_pos, stride_cache_head, stride_table,
            GROUP, BLOCK_SIZE, HEAD_DIM, BLOCK_M, BLOCK_N, DOT_PRECISION, KV_FP8, DOT_F16, WINDOW, KV_INT8,
        )
    else:  # the decode grid (split fastest, then KV head, then sequence); decode row = token = sequence
        d = pid - prefill_programs
        rest = d // num_splits
        decode_split_program(
            rest // (num_q_heads // GROUP), rest % (num_q_heads // GROUP), d % num_splits,
            query, k_cache, v_cache, out, partial_out, partial_lse, counters, seq_lens, block_tables, scale_log2,
            k_scale, v_scale,
            stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
            stride_cache_block, stride_cache_pos, stride_cache_head, stride_table,
            num_q_heads,
            GROUP, BLOCK_H, BLOCK_SIZE, HEAD_DIM, DECODE_BLOCK_N, num_splits, DOT_PRECISION, KV_FP8, DOT_F16,
            True,  # with several splits the last arrival merges them (no merge launch, no merge variants)
            WINDOW, KV_INT8,
        )


def plan_key(query: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor, kv_fp8: bool, window: int = 0) -> tuple:
    """What a plan was validated and built for: a layer whose tensors give the same key (and sliding window)
    may reuse it."""
    return (query.shape, query.stride(), query.dtype, k_cache.shape, k_cache.stride(), k_cache.dtype,
            out.stride(), query.device, kv_fp8) + ((window,) if window else ())


@dataclass
class PagedAttentionPlan:
    """The launches of one step's paged attention with every per-layer invariant computed (see module doc)."""

    key: tuple  # plan_key of the tensors it was built for
    kv_fp8: bool
    metadata: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # cu_seqlens_q, seq_lens, block_tables (whole)
    prefill_metadata: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # the prompt chunks' (two-launch path)
    strides: tuple[int, ...]  # q tok/head, out tok/head, cache block/pos/head, table
    mixed: tuple[tuple[int], tuple[Any, ...], dict[str, Any]] | None  # the one-launch kernel: grid, ints, meta
    decode: tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any]] | None  # decode-only step
    prefill: tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any]] | None  # prefill-only step
    partial_shape: tuple[int, int, int, int]  # float32 split outputs [D_seqs, Hq, S, D] (log-sum-exps without D)
    share_partials: bool  # one pair for every layer (else a fresh pair per launch: see plan_paged_attention)
    counters: torch.Tensor | None  # arrival counters of the decode splits that merge themselves (mixed kernel too)
    partials: tuple[torch.Tensor, torch.Tensor] | None = None  # the shared pair, made by the first launch

    @property
    def decode_any_splits(self) -> bool:
        """A mixed step in two launches: `decode` launches `_decode_any_splits_kernel` (runtime split count)."""
        return self.decode is not None and self.prefill is not None

    def _partials(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The split partials (with one split the kernel writes `out` directly: it stands in for both,
        except in the mixed kernel, whose pointer types must not follow the split count). Shared by every
        layer: stream order keeps one layer's merging splits before the next layer's."""
        if self.partial_shape[2] == 1 and self.mixed is None and not self.decode_any_splits:
            return out, out
        if self.partials is not None:
            return self.partials
        pair = (torch.empty(self.partial_shape, dtype=torch.float32, device=out.device),
                torch.empty(self.partial_shape[:3], dtype=torch.float32, device=out.device))
        if self.share_partials:
            self.partials = pair
        return pair

    def launch(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
               scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Attend `query` [T, Hq, D] into `out` over this layer's cache: the kernel launches only. The
        caller keeps the tensors to the plan's key (the same shapes, strides and dtypes in every layer)."""
        cu_seqlens, seq_lens, tables = self.metadata
        scale_log2 = scale * _LOG2_E
        ks, vs = (k_scale, v_scale) if self.kv_fp8 else (seq_lens, seq_lens)  # unread without KV_FP8
        partial_out, partial_lse = self._partials(out)
        if self.mixed is not None:
            grid, ints, meta = self.mixed
            _mixed_paged_attention_kernel[grid](
                query, k_cache, v_cache, out, partial_out, partial_lse, self.counters, cu_seqlens, seq_lens, tables,
                scale_log2, ks, vs, *self.strides, *ints, **meta)
        if self.decode is not None:
            grid, ints, meta = self.decode
            kernel = _decode_any_splits_kernel if self.decode_any_splits else _decode_split_kernel
            kernel[grid](
                query, k_cache, v_cache, out, partial_out, partial_lse,
                self.counters if self.counters is not None else seq_lens, seq_lens, tables,
                scale_log2, ks, vs, *self.strides, *ints, **meta)
        if self.prefill is not None:
            grid, _, meta = self.prefill
            _paged_prefill_kernel[grid](query, k_cache, v_cache, out, *self.prefill_metadata, scale_log2, ks, vs,
                                        *self.strides, **meta)
        return out


def plan_paged_attention(
    query: torch.Tensor,  # [T, Hq, D], contiguous head_dim; the decode rows' tokens first
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [T, Hq, D]
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, M] int32
    num_decode: int,  # the first num_decode sequences have query length 1
    max_query_len: int,  # over the prompt chunks (any value when num_decode == B)
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    decode_config: DecodeConfig | None = None,
    prefill_config: PrefillConfig | None = None,
    share_partials: bool = True,
    decode_rows_elsewhere: bool = False,
    window: int = 0,
) -> PagedAttentionPlan:
    """Validate one layer's tensors and plan the step's launches: the decode rows exactly as
    `paged_decode_attention(query[:num_decode], ...)` (same split count and config), the prompt chunks
    exactly as `paged_prefill_attention` over the rest; one launch for both where the two configs share
    num_warps, else the two kernels back to back.

    `decode_rows_elsewhere`: the caller attends the first `num_decode` rows itself (a mixed step's decode rows
    on a CUDA decode kernel, models/layers/attention.py): the plan launches the prefill kernel over the prompt
    chunks only (nothing where the step has none).

    `share_partials`: allocate the split partials once for every layer. Not for a step that may run
    inside a CUDA-graph capture after warm-up runs over the same metadata (the decode graphs): the
    plan made in the warm-up would hand the graph buffers from outside its pool, freed when the
    metadata is; there every launch allocates its own, as `paged_decode_attention` does.

    `window` > 0: a sliding window (each query sees its last `window` positions), as the two kernels take it.
    An int8 cache: `query` and `out` in the rotated basis, as the two kernels take them."""
    check_attention_inputs("paged_attention_plan", query, k_cache, v_cache)
    kv_fp8 = check_kv_scales("paged_attention_plan", k_cache, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if query.stride(2) != 1 or out.stride(2) != 1 or out.shape != query.shape:
        raise ValueError("paged_attention_plan: query and out must be [T, Hq, D] with a contiguous head_dim")
    if not 0 <= num_decode <= min(num_seqs, num_tokens):
        raise ValueError(f"paged_attention_plan: num_decode must be in [0, {min(num_seqs, num_tokens)}], "
                         f"got {num_decode}")
    group = num_q_heads // num_kv_heads
    strides = (query.stride(0), query.stride(1), out.stride(0), out.stride(1),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0))
    common = dict(GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, DOT_PRECISION=dot_precision(query.dtype),
                  KV_FP8=kv_fp8, DOT_F16=fp8_dot_in_f16(kv_fp8, query.dtype), **pdl_launch(query.device),
                  **({"WINDOW": window} if window else {}), **({"KV_INT8": True} if is_int8_cache(k_cache) else {}))
    num_prefill = num_seqs - num_decode
    has_prefill = num_prefill > 0 and num_tokens > num_decode and max_query_len > 0
    dcfg = decode_config or default_decode_config(head_dim, query.device, kv_fp8)
    pcfg = prefill_config or default_prefill_config(head_dim, query.device)

    num_splits, decode_meta, counters = 1, None, None
    num_decode_launched = 0 if decode_rows_elsewhere else num_decode
    if num_decode_launched:
        num_splits = split_count("paged_attention_plan", None, num_decode, k_cache, block_tables, dcfg, window)
        decode_meta = dict(BLOCK_H=decode_block_h(group), NUM_SPLITS=num_splits)
    prefill_grid = (math.ceil(max_query_len / pcfg.block_m), num_q_heads, num_prefill) if has_prefill else None
    mixed = decode = prefill = None
    if num_decode_launched and has_prefill and dcfg.num_warps == pcfg.num_warps:
        num_q_tiles = prefill_grid[0]
        prefill_programs = num_q_tiles * num_q_heads * num_prefill
        grid = (prefill_programs + num_decode * num_kv_heads * num_splits,)
        # the split count is a runtime int and the splits merge themselves: one compiled kernel for every
        # batch composition (a constexpr split count compiled a variant per count in the middle of a job)
        counters = merge_counters(query.device, num_decode * num_kv_heads)
        mixed = (grid, (num_q_heads, num_decode, num_q_tiles, prefill_programs, num_splits), dict(
            **common, BLOCK_H=decode_meta["BLOCK_H"], DECODE_BLOCK_N=dcfg.block_n, BLOCK_M=pcfg.block_m,
            BLOCK_N=pcfg.block_n,
            # the prompt chunks carry the step's compute: their pipelining (registers are the larger body's)
            num_warps=pcfg.num_warps, num_stages=pcfg.num_stages))
    else:
        if num_decode_launched and has_prefill:
            # a mixed step in two launches: the split count is a runtime int and the splits merge themselves
            # (`_decode_any_splits_kernel`: one compiled kernel whatever the step's decode rows)
            counters = merge_counters(query.device, num_decode * num_kv_heads)
            decode = ((num_splits, num_kv_heads, num_decode), (num_q_heads, num_splits), dict(
                **common, BLOCK_H=decode_meta["BLOCK_H"], BLOCK_N=dcfg.block_n,
                num_warps=dcfg.num_warps, num_stages=dcfg.num_stages))
        elif num_decode_launched:
            # a decode-only step's splits merge themselves (the last arrival per (sequence, KV head); no launch)
            fused_merge = num_splits > 1
            if fused_merge:
                counters = merge_counters(query.device, num_decode * num_kv_heads)
            decode = ((num_splits, num_kv_heads, num_decode), (num_q_heads,), dict(
                **common, **decode_meta, BLOCK_N=dcfg.block_n, FUSED_MERGE=fused_merge,
                num_warps=dcfg.num_warps, num_stages=dcfg.num_stages))
        if has_prefill:
            prefill = (prefill_grid, (), dict(**common, BLOCK_M=pcfg.block_m, BLOCK_N=pcfg.block_n,
                                              num_warps=pcfg.num_warps, num_stages=pcfg.num_stages))
    prefill_metadata = (cu_seqlens_q, seq_lens, block_tables)
    if prefill is not None and num_decode:
        # the prompt part's small tensors copied, not sliced: a slice starting at sequence n is 16-byte aligned
        # only when n is, and Triton compiles a kernel per pointer alignment (a second prefill kernel compiled
        # in the middle of a job: ~1 s of one mixed step on an H200)
        prefill_metadata = (cu_seqlens_q[num_decode:].clone(), seq_lens[num_decode:].clone(),
                            block_tables[num_decode:])
    return PagedAttentionPlan(plan_key(query, k_cache, out, kv_fp8, window), kv_fp8,
                              (cu_seqlens_q, seq_lens, block_tables), prefill_metadata, strides, mixed, decode, prefill,
                              (num_decode, num_q_heads, num_splits, head_dim), share_partials, counters)
