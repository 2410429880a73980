"""Decode attention that first prepares its own inputs: the q/k per-head norm, rotary and the new token's K/V
store of `qk_norm_rope_store`, done by the attention programs themselves (one launch a layer fewer).

Why: on a decode step the store kernel is a ~2.7 us launch per layer (28 a step on Qwen3-0.6B) that moves a few
kilobytes; the attention programs already own exactly the rows it touches. Program (split, KV head, sequence)
rotates the GROUP query heads of its KV head into `q_rot` (each split the same bits: the rows it reads are the
rows it wrote, or equal ones another split wrote), and the split holding the sequence's last position (the new
token's) also normalises, rotates and stores that token's K/V. A CTA barrier then orders these writes before the
split's keys are read, and the rest is `decode_split_program`, the decode kernel's body.

Bits: the prologue is `qk_norm_rope_store`'s own code (`rotate_q_rows`, `store_kv_rows`) on [ROWS, D] tiles
with ROWS = the decode tile's num_warps, the tiles that kernel uses at ROWS heads per program (one warp per row,
the norm's sum in rms_norm_pair's order), and the attention body is the decode kernel's: the output equals
`qk_norm_rope_store` followed by `paged_decode_attention`, and so does the cache.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.attention_support import check_attention_inputs, dot_precision
from spmd_engine.kernels.decode_attention import (
    _LOG2_E,
    DecodeConfig,
    _split_partials,
    decode_block_h,
    decode_split_program,
    default_decode_config,
    merge_counters,
    split_count,
)
from spmd_engine.kernels.kv_quant import FP8_DTYPE, check_kv_scales
from spmd_engine.kernels.paged_kv_tile import fp8_dot_in_f16
from spmd_engine.kernels.pdl import pdl_launch, pdl_prologue
from spmd_engine.kernels.qk_norm_rope_store import _cos_sin, can_fuse, check_qk_inputs, rotate_q_rows, store_kv_rows

# The caches whose decode steps prepare q/k inside the attention launch; others run qk_norm_rope_store first (same
# bits). H200, Qwen3-0.6B, `python run.py workload=bench` (GPU time per decode step): an fp8 cache's decode
# step 3.768 -> 3.610 ms of GPU time, a bf16 cache's 4.546 -> 4.574 ms (the longer prologue outweighs the launch).
ROTARY_IN_DECODE_CACHES: tuple[torch.dtype, ...] = (FP8_DTYPE,)


@triton.jit
def _rotary_decode_kernel(
    q, k, v, cos, sin, q_weight, k_weight, q_normed, k_normed, q_rot, slot_mapping,
    k_cache, v_cache, out, partial_out, partial_lse, counters, seq_lens, block_tables, scale_log2, k_scale, v_scale,
    num_cols, half, eps,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_cs_tok,
    stride_o_seq, stride_o_head, stride_cache_block, stride_cache_pos, stride_cache_head, stride_table,
    num_q_heads,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    DOT_F16: tl.constexpr, FUSED_MERGE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    split, kv_head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tok = seq.to(tl.int64)  # a decode step: token = sequence
    num_kv_heads = num_q_heads // GROUP
    c, s = _cos_sin(cos, sin, tok, stride_cs_tok, half, BLOCK_HALF)
    first = kv_head * GROUP
    q_row = tok * num_q_heads * num_cols
    for r in tl.static_range(0, GROUP, ROWS):
        heads = first + r + tl.arange(0, ROWS)[:, None]
        rotate_q_rows(q + tok * stride_q_tok, stride_q_head, q_weight, q_normed + q_row, q_rot + q_row, c, s, heads,
                      first + GROUP, num_cols, half, eps, HAS_NORM, BLOCK_D, BLOCK_HALF)
    # the split holding position seq_len - 1 (decode_split_program's ranges) stores the new token's K/V
    seq_len = tl.load(seq_lens + seq)
    split_len = tl.cdiv(seq_len, NUM_SPLITS * BLOCK_N) * BLOCK_N
    start = split * split_len
    if (start < seq_len) & (seq_len <= start + split_len):
        heads = kv_head + tl.arange(0, ROWS)[:, None]
        store_kv_rows(k + tok * stride_k_tok, stride_k_head, v + tok * stride_v_tok, stride_v_head, k_weight,
                      k_normed + tok * num_kv_heads * num_cols, slot_mapping + tok, c, s, heads, kv_head + 1,
                      num_cols, half, eps, k_cache, v_cache, k_scale, v_scale, stride_cache_block,
                      stride_cache_pos, stride_cache_head, BLOCK_SIZE, HAS_NORM, KV_FP8, BLOCK_D, BLOCK_HALF)
    tl.debug_barrier()  # the rotated q and the new K/V are in memory before any thread reads them
    decode_split_program(
        seq, kv_head, split,
        q_rot, k_cache, v_cache, out, partial_out, partial_lse, counters, seq_lens, block_tables, scale_log2,
        k_scale, v_scale,
        num_q_heads * num_cols, num_cols, stride_o_seq, stride_o_head,
        stride_cache_block, stride_cache_pos, stride_cache_head, stride_table,
        num_q_heads,
        GROUP, BLOCK_H, BLOCK_SIZE, HEAD_DIM, BLOCK_N, NUM_SPLITS, DOT_PRECISION, KV_FP8, DOT_F16, FUSED_MERGE,
    )


def prologue_rows(num_warps: int, head_dim: int, element_size: int) -> int:
    """Heads per prologue tile: the decode tile's warps (one warp a row, as qk_norm_rope_store at that many
    rows), or 0 where that kernel would not use such a tile (a padded row over 32 lanes of 16 bytes, or a
    warp count it never runs): then this kernel does not apply."""
    if num_warps not in (1, 2, 4, 8) or triton.next_power_of_2(head_dim) * element_size > 32 * 16:
        return 0
    return num_warps


def can_rotate_in_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         has_norm: bool, k_cache: torch.Tensor, config: DecodeConfig | None = None) -> bool:
    """Whether `rotary_decode_attention` takes these tensors (else: qk_norm_rope_store, then decode attention)."""
    if not can_fuse(q, k, v, cos, sin, has_norm):
        return False
    cfg = config or default_decode_config(q.shape[-1], q.device, k_cache.dtype == FP8_DTYPE)
    return prologue_rows(cfg.num_warps, q.shape[-1], q.element_size()) > 0


def rotary_decode_attention(
    q: torch.Tensor,  # [B, Hq, D] one token per sequence, last dim contiguous (a slice of the qkv output)
    k: torch.Tensor,  # [B, Hkv, D], same
    v: torch.Tensor,  # [B, Hkv, D], same
    cos: torch.Tensor,  # [B, D/2], the tokens' rotary tables (last dim contiguous)
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [B]; -1: not stored (padding rows)
    seq_lens: torch.Tensor,  # [B] int32, the new token included
    block_tables: torch.Tensor,  # [B, M] int32
    scale: float,
    out: torch.Tensor | None = None,  # [B, Hq, D], contiguous head_dim
    *,
    q_weight: torch.Tensor | None = None,  # [D] per-head RMSNorm weights (Qwen3); None: no norm (Llama)
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    k_scale: torch.Tensor | None = None,  # [Hkv] float32, only with a float8_e4m3fn cache
    v_scale: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """attention(rotary(norm(q)), cache with rotary(norm(k)), v stored at slot_mapping) -> [B, Hq, D]: the
    bits of `qk_norm_rope_store` followed by `paged_decode_attention` (output and cache)."""
    has_norm = check_qk_inputs("rotary_decode_attention", q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                               q_weight, k_weight)
    check_attention_inputs("rotary_decode_attention", q, k_cache, v_cache)
    kv_fp8 = check_kv_scales("rotary_decode_attention", k_cache, k_scale, v_scale)
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    cfg = config or default_decode_config(head_dim, q.device, kv_fp8)
    rows = prologue_rows(cfg.num_warps, head_dim, q.element_size())
    if rows == 0:
        raise ValueError(f"rotary_decode_attention: the decode tile must have 1, 2, 4 or 8 warps and a head row "
                         f"within one warp's 512 bytes; got {cfg.num_warps} warps, D={head_dim} {q.dtype}")
    if seq_lens.shape != (num_seqs,) or block_tables.shape[0] != num_seqs:
        raise ValueError(f"rotary_decode_attention: seq_lens [{num_seqs}] and block_tables [{num_seqs}, M] "
                         f"expected, got {tuple(seq_lens.shape)} and {tuple(block_tables.shape)}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.stride(2) != 1:
        raise ValueError("rotary_decode_attention: out must be [B, Hq, D] with a contiguous head_dim")
    if num_seqs == 0:
        return out
    num_splits = split_count("rotary_decode_attention", num_splits, num_seqs, k_cache, block_tables, cfg)
    group = num_q_heads // num_kv_heads
    q_rot = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # the rotated queries the splits attend with
    q_normed = torch.empty_like(q_rot) if has_norm else q_rot  # the normed rows between the phases
    k_normed = torch.empty(k.shape, dtype=k.dtype, device=k.device) if has_norm else q_rot
    partial_out, partial_lse = _split_partials(q_rot, out, num_splits)
    fused = num_splits > 1
    counters = merge_counters(q.device, num_seqs * num_kv_heads) if fused else seq_lens  # unread with one split
    unread = slot_mapping
    _rotary_decode_kernel[(num_splits, num_kv_heads, num_seqs)](
        q, k, v, cos, sin,
        q_weight if has_norm else q, k_weight if has_norm else q,  # unread without HAS_NORM
        q_normed, k_normed, q_rot, slot_mapping,
        k_cache, v_cache, out, partial_out, partial_lse, counters, seq_lens, block_tables, scale * _LOG2_E,
        k_scale if kv_fp8 else unread, v_scale if kv_fp8 else unread,  # unread without KV_FP8
        head_dim, head_dim // 2, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        num_q_heads,
        ROWS=rows, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        HAS_NORM=has_norm, GROUP=group, BLOCK_H=decode_block_h(group), BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_N=cfg.block_n, NUM_SPLITS=num_splits, DOT_PRECISION=dot_precision(q.dtype), KV_FP8=kv_fp8,
        DOT_F16=fp8_dot_in_f16(kv_fp8, q.dtype), FUSED_MERGE=fused, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_launch(q.device),
    )
    return out
