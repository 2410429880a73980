"""Triton flash-attention over a varlen batch whose keys/values live in the paged KV cache.

One program owns BLOCK_M new query tokens of one sequence and one query head; it streams that
sequence's cached + new keys through the block table with an fp32 online softmax. The causal
mask is aligned lower-right, so a cached prefix (seq_len > q_len) is fully visible. A
float8_e4m3fn cache is upcast on load; its per-KV-head scales are folded into the score scale (K)
and the final output (V). A sliding window (WINDOW > 0: a query sees its last WINDOW positions) starts
each program at the first tile its first row sees and masks the tiles the window's lower edge crosses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.attention_support import check_attention_inputs, dot_precision, is_int8_cache
from spmd_engine.kernels.kv_quant import check_kv_scales
from spmd_engine.kernels.paged_kv_tile import (
    E4M3_MAX,
    fp8_dot_in_f16,
    fp8_dot_operand,
    fp8_v_pair_rows,
    int8_row_scales,
    online_softmax_step,
    paged_tile,
    paged_tile_offsets,
)
from spmd_engine.kernels.pdl import pdl_launch, pdl_prologue

_LOG2_E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    """Tile shape and pipelining of one launch (picked by head_dim and device, no autotune)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def default_prefill_config(head_dim: int, device: torch.device) -> PrefillConfig:
    if device.type != "cuda":  # TRITON_INTERPRET: small tiles keep the emulation fast
        return PrefillConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
    if head_dim <= 64:
        return PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)
    if head_dim <= 128:  # H200 sweep, 16x1024 bf16: 249 TFLOP/s vs 213 for (128, 64, 8 warps, 3)
        return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
    return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)


@triton.jit
def windowed_softmax_step(scores, m_i, l_i):
    """`online_softmax_step` for rows that may see no key of a tile yet (a sliding window's lower edge): a row
    max still -inf subtracts 0, so its p and rescale are 0, not NaN. Where the max is finite, the same bits."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(scores - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, k_cache, v_cache, block_table_row, tile_start, seq_len, kv_head_offset,
    query_pos, scale_log2, stride_block, stride_pos,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, WINDOW: tl.constexpr = 0,
    KV_INT8: tl.constexpr = False,
):
    if KV_FP8:
        # the tile's keys as its even positions, then its odd ones: V's pair rows (kv_quant.FP8_V_LAYOUT) split
        # by parity then stack in that order, each thread's 16 loaded bytes giving two 8-wide row pieces, and
        # K's rows (a gather by position anyway) follow the same order, so P splits by column halves. Why: a
        # [BLOCK_N, HEAD_DIM] operand in position order re-interleaved the pairs through 32-bit shared stores,
        # 616 us per 16 x 1,024 prefill on the H200 against 364 us this way (the plain layout's: 333 us;
        # `python launch/bench/bench_attention.py`). The keys' order changes only the float32 sums' rounding.
        keys = tl.arange(0, BLOCK_N)
        positions = tile_start + tl.where(keys < BLOCK_N // 2, 2 * keys, 2 * keys - (BLOCK_N - 1))
        valid = positions < seq_len
        rows = paged_tile_offsets(block_table_row, tile_start, positions, valid, stride_block, stride_pos,
                                  BLOCK_SIZE, BLOCK_N)
    else:
        positions, valid, rows = paged_tile(block_table_row, tile_start, seq_len, stride_block, stride_pos,
                                            BLOCK_SIZE, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    offsets = rows[:, None] + kv_head_offset + dims[None, :]
    if MASKED:
        k = tl.load(k_cache + offsets, mask=valid[:, None], other=0.0)
    else:
        k = tl.load(k_cache + offsets)
    if KV_FP8:
        pair_valid, pair_rows = fp8_v_pair_rows(block_table_row, tile_start, seq_len, stride_block, stride_pos,
                                                BLOCK_SIZE, BLOCK_N)
        pairs = v_cache + (pair_rows[:, None] + 2 * kv_head_offset + tl.arange(0, 2 * HEAD_DIM)[None, :])
        if MASKED:
            raw = tl.load(pairs, mask=pair_valid[:, None], other=0.0)
        else:
            raw = tl.load(pairs)
        # upcast, then split: a converted pair (even, odd of one dim) is one register, and one byte-permute per
        # output register regroups them (splitting the bytes first took twice the permutes in the SASS;
        # H200, fp8 prefill 16 x 1,024: 362 -> 349 us, `python launch/bench/bench_attention.py`)
        v_even, v_odd = tl.split(tl.reshape(raw.to(q.dtype), [BLOCK_N // 2, HEAD_DIM, 2]))
        if MASKED:  # an odd end's partner (a stale or unwritten byte, maybe NaN; its p is 0): made finite
            v_odd = tl.minimum(v_odd, tl.full([BLOCK_N // 2, HEAD_DIM], E4M3_MAX, q.dtype))
    elif MASKED:
        v = tl.load(v_cache + offsets, mask=valid[:, None], other=0.0)
    else:
        v = tl.load(v_cache + offsets)
    if KV_FP8 and q.dtype == tl.float32:  # float32 model: upcast exactly, dot in float32
        k = k.to(tl.float32)
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
    if KV_INT8:  # q.(s_k k8) = s_k (q.k8): the int8 values go into the dot exactly, the row scales after it
        scores = scores * int8_row_scales(k_cache, rows, kv_head_offset, valid, HEAD_DIM)[None, :]
    if MASKED:
        visible = (positions[None, :] <= query_pos[:, None]) & valid[None, :]
        if WINDOW > 0:
            visible = visible & (positions[None, :] > query_pos[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
    if WINDOW > 0:
        p, alpha, m_new, l_i = windowed_softmax_step(scores, m_i, l_i)
    else:
        p, alpha, m_new, l_i = online_softmax_step(scores, m_i, l_i)
    if KV_FP8:  # P's first half of columns meets the even positions, its second half the odd ones
        p_even, p_odd = tl.split(tl.permute(tl.reshape(p.to(q.dtype), [p.shape[0], 2, BLOCK_N // 2]), (0, 2, 1)))
        pv = tl.dot(p_even, v_even, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + tl.dot(p_odd, v_odd, pv, input_precision=DOT_PRECISION)
    else:
        if KV_INT8:  # sum p (s_v v8) = sum (p s_v) v8
            p = p * int8_row_scales(v_cache, rows, kv_head_offset, valid, HEAD_DIM)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def prefill_program(
    q_tile, head, seq,
    query, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, scale_log2, k_scale, v_scale,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_cache_block, stride_cache_pos, stride_cache_head, stride_table,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    DOT_F16: tl.constexpr, WINDOW: tl.constexpr = 0, KV_INT8: tl.constexpr = False,
):
    """One (query tile, query head, sequence) of the prefill kernel: shared with the mixed-batch
    kernel (kernels/mixed_attention.py), so a prompt chunk computes the same bits in either launch."""
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    first_row = q_tile * BLOCK_M
    if first_row >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    context_len = seq_len - q_len  # cached prefix before the new tokens

    rows = first_row + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_valid = rows < q_len
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(
        query + tokens[:, None] * stride_q_tok + head * stride_q_head + dims[None, :],
        mask=row_valid[:, None], other=0.0,
    )
    if DOT_F16:
        q = fp8_dot_operand(q)
    query_pos = context_len + rows

    block_table_row = block_tables + seq.to(tl.int64) * stride_table
    kv_head_offset = (head // GROUP).to(tl.int64) * stride_cache_head
    if KV_FP8:  # dequantization folded: q.(s_k k8) = s_k (q.k8)
        scale_log2 = scale_log2 * tl.load(k_scale + head // GROUP)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # keys every row of this tile sees (all < seq_len): no mask needed
    unmasked_end = ((context_len + first_row + 1) // BLOCK_N) * BLOCK_N
    unmasked_start = 0
    if WINDOW > 0:
        # below the first row's window no row sees a key; up to the last row's window's lower edge some row
        # of the tile does not see every key: those tiles are masked
        window_start = (tl.maximum(context_len + first_row + 1 - WINDOW, 0) // BLOCK_N) * BLOCK_N
        unmasked_start = tl.minimum(
            tl.cdiv(tl.maximum(context_len + first_row + BLOCK_M - WINDOW, 0), BLOCK_N) * BLOCK_N, unmasked_end)
        for tile_start in range(window_start, unmasked_start, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, k_cache, v_cache, block_table_row, tile_start, seq_len,
                kv_head_offset, query_pos, scale_log2, stride_cache_block, stride_cache_pos,
                BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, DOT_PRECISION, KV_FP8, WINDOW, KV_INT8,
            )
    for tile_start in range(unmasked_start, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache, v_cache, block_table_row, tile_start, seq_len,
            kv_head_offset, query_pos, scale_log2, stride_cache_block, stride_cache_pos,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, DOT_PRECISION, KV_FP8, 0, KV_INT8,
        )
    # the diagonal band and the sequence end: causal + length mask
    masked_end = tl.minimum(seq_len, context_len + first_row + BLOCK_M)
    for tile_start in range(unmasked_end, masked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache, v_cache, block_table_row, tile_start, seq_len,
            kv_head_offset, query_pos, scale_log2, stride_cache_block, stride_cache_pos,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, DOT_PRECISION, KV_FP8, WINDOW, KV_INT8,
        )

    if WINDOW > 0:  # a padding row past the sequence may see no key: 0, not 0 / 0 (it is not stored)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / l_i[:, None]
    if KV_FP8:  # sum p (s_v v8) = s_v sum p v8
        result = result * tl.load(v_scale + head // GROUP)
    tl.store(
        out + tokens[:, None] * stride_o_tok + head * stride_o_head + dims[None, :],
        result.to(out.dtype.element_ty),
        mask=row_valid[:, None],
    )


@triton.jit
def _paged_prefill_kernel(
    query, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, scale_log2, k_scale, v_scale,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_cache_block, stride_cache_pos, stride_cache_head, stride_table,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    DOT_F16: tl.constexpr,
    USE_PDL: tl.constexpr, WINDOW: tl.constexpr = 0, KV_INT8: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    prefill_program(
        tl.num_programs(0) - 1 - tl.program_id(0),  # longest causal rows start first
        tl.program_id(1), tl.program_id(2),
        query, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, scale_log2, k_scale, v_scale,
        stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
        stride_cache_block, stride_cache_pos, stride_cache_head, stride_table,
        GROUP, BLOCK_SIZE, HEAD_DIM, BLOCK_M, BLOCK_N, DOT_PRECISION, KV_FP8, DOT_F16, WINDOW, KV_INT8,
    )


def paged_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, M] int32
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    *,
    config: PrefillConfig | None = None,
    k_scale: torch.Tensor | None = None,  # [Hkv] float32, only with a float8_e4m3fn cache
    v_scale: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached + new keys; returns [T, Hq, D].
    `window` > 0: each query sees only its last `window` positions (a sliding window). An int8 cache
    ([N, bs, Hkv, D + 4]): `query` and the result are in the rotated basis (kernels/kv_int8.py)."""
    check_attention_inputs("paged_prefill_attention", query, k_cache, v_cache)
    kv_fp8 = check_kv_scales("paged_prefill_attention", k_cache, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    if out.stride(2) != 1:
        raise ValueError("paged_prefill_attention: out must have a contiguous head_dim")
    cfg = config or default_prefill_config(head_dim, query.device)
    grid = (math.ceil(max_query_len / cfg.block_m), num_q_heads, num_seqs)
    _paged_prefill_kernel[grid](
        query, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, scale * _LOG2_E,
        k_scale if kv_fp8 else seq_lens, v_scale if kv_fp8 else seq_lens,  # unread without KV_FP8
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=num_q_heads // k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DOT_PRECISION=dot_precision(query.dtype), KV_FP8=kv_fp8,
        DOT_F16=fp8_dot_in_f16(kv_fp8, query.dtype), WINDOW=window,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(query.device),
        **({"KV_INT8": True} if is_int8_cache(k_cache) else {}),
    )
    return out
