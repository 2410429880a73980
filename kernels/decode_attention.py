"""Triton flash-decoding: one new query token per sequence against its paged KV cache.

A program owns one (sequence, KV head, split): the GROUP query heads that share the KV head are
packed into one tile, so each K/V tile is loaded once for all of them. Long contexts are cut into
NUM_SPLITS ranges whose partial (output, log-sum-exp) are merged; with one split the first kernel
writes the output directly. The last split program of each (sequence, KV head) to finish merges them: it
counts arrivals on a persistent int32 counter and resets it (one launch: at batch 1 a separate merge kernel
was a ~2.7 us launch per layer, the `merge` rows of `python launch/bench/bench_attention.py`). It merges
through `_merge_partials`, whose order of operations is explicit (sequential over splits), so the tile
shape and warp count of the merging program cannot change it: the tests' second-launch merge
(tests/helpers/split_oracles.py), written apart in the same order, must give the same bits from the
partials the split kernel leaves with FUSED_MERGE off.
The grid is (split, KV head, sequence), the sequence slowest: the GPU starts programs in grid order, so
a batch ordered longest context first (the engine's, `executor/forward_batch.batch_order`) starts every
program of its longest rows first and the short ones fill the tail. Sequence fastest, a KV head's programs
all started before the next head's, and the last head's long rows ran on alone (H200, 129 rows of 200..2000
keys, one split: 162.8 -> 152.7 us in bf16, 155.8 -> 127.1 us with an fp8 cache;
`python launch/bench/bench_attention.py`). The grid and NUM_SPLITS come only from tensor shapes and each
split's range is computed on the device from seq_lens, so the launch is CUDA-graph safe; a split past a
sequence's end writes a neutral partial (lse = -inf, output 0). With a sliding window (WINDOW > 0) the splits
share only the window's keys, from the tile holding its first one. A float8_e4m3fn cache is upcast on load
(exact into fp16/bf16/fp32); its per-KV-head scales are folded into the score scale (K) and the split's
output (V), so the inner loop does no extra multiplies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.attention_support import check_attention_inputs, dot_precision, is_int8_cache
from spmd_engine.kernels.kv_quant import check_kv_scales
from spmd_engine.kernels.paged_kv_tile import (
    fp8_dot_in_f16,
    fp8_dot_operand,
    fp8_v_operand,
    fp8_v_pair_rows,
    fp8_v_rows,
    int8_row_scales,
    online_softmax_step,
    paged_tile,
)
from spmd_engine.kernels.pdl import pdl_launch, pdl_prologue

_LOG2_E = 1.4426950408889634
# Below this a split's merge costs more than its extra parallelism. H200, batch 1, a 4k-wide table in a graph of
# 28 layers (`python launch/bench/bench_attention.py --splits`): 256 gives 16 splits, 7.1 / 11.2 / 14.6 us per
# layer at context 650 / 2000 / 4000, where 128 (32 splits) gave 8.0 / 12.8 / 18.0.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
# The splits are merged by the last-arriving split program. The arrival counters are one int32 per
# (sequence, KV head) per device, shared by every call: decode attention must not run concurrently on two
# streams of one device (the engine runs its forward on one).
MIN_COUNTERS = 4096  # the first allocation: above any automatic split case (B * Hkv < programs wanted)


@dataclass(frozen=True)
class DecodeConfig:
    """Tile shape and pipelining of the split kernel (picked by device, no autotune)."""

    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int  # target resident programs per SM when choosing the split count
    min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT  # table positions per split at the least
    small_second_wave: float = 0.0  # decode_num_splits: a split fewer rather than this small an overshoot


def default_decode_config(head_dim: int, device: torch.device, kv_fp8: bool = False) -> DecodeConfig:
    if device.type != "cuda":  # TRITON_INTERPRET: small tiles keep the emulation fast
        return DecodeConfig(block_n=16, num_warps=1, num_stages=1, programs_per_sm=1)
    if kv_fp8 and head_dim == 128:
        # one warp keeps P in registers (four pass it through shared memory every tile: the fp8 loop is bound by
        # instruction issue). H200, alone, sequence-slowest grid: 129 rows x 200..2000 keys 122.9 us against
        # 127.2 for 128 / 4 / 3, 256 x 100..1500 139.9 against 162.0 (`python launch/bench/bench_attention.py --sweep`)
        return DecodeConfig(block_n=64, num_warps=1, num_stages=3, programs_per_sm=4)
    if head_dim <= 128:
        # H200, sequence-slowest grid: alone 151.8 us against 152.2 for 128 keys / 3 stages (129 rows x 200..2000),
        # 206.5 against 211.3 (256 rows; `python launch/bench/bench_attention.py --sweep`); engine bench
        # (`python run.py workload=bench`) 26,537 / 26,613 tok/s against 26,334 / 26,332
        return DecodeConfig(block_n=64, num_warps=4, num_stages=2, programs_per_sm=4)
    return DecodeConfig(block_n=32, num_warps=4, num_stages=2, programs_per_sm=4)


@lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(
    num_seqs: int, num_kv_heads: int, max_blocks: int, block_size: int, target_programs: int,
    min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT, small_second_wave: float = 0.0,
) -> int:
    """Splits per (sequence, KV head): enough programs to fill the GPU, from shapes only. With
    `small_second_wave` > 0, one split fewer where the count that fills the GPU would overshoot
    `target_programs` (the resident programs) by at most that fraction: the few programs past them would
    run alone afterwards (see `decode_attention_cuda.SMALL_SECOND_WAVE`)."""
    max_context = max_blocks * block_size
    by_length = math.ceil(max_context / min_tokens_per_split)
    pairs = max(1, num_seqs * num_kv_heads)
    by_occupancy = math.ceil(target_programs / pairs)
    if by_occupancy > 1 and pairs * by_occupancy <= target_programs * (1 + small_second_wave) \
            and pairs * by_occupancy > target_programs:
        by_occupancy -= 1
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def split_count(kernel: str, num_splits: int | None, num_seqs: int, k_cache: torch.Tensor,
                block_tables: torch.Tensor, cfg: DecodeConfig, window: int = 0) -> int:
    """`num_splits`, or when None the count that fills the GPU (`decode_num_splits`); one line naming the
    kernel when it is out of range. The one rule for the decode kernel and the attention plan. A sliding
    `window` bounds the keys a row reads: no more splits than its tiles need."""
    if num_splits is None:
        target = cfg.programs_per_sm * _num_sms(k_cache.device)
        max_blocks = block_tables.shape[1]
        if window > 0:
            max_blocks = min(max_blocks, -(-(window + cfg.block_n) // k_cache.shape[1]))
        num_splits = decode_num_splits(num_seqs, k_cache.shape[2], max_blocks, k_cache.shape[1], target,
                                       cfg.min_tokens_per_split, cfg.small_second_wave)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"{kernel}: num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    return num_splits


def decode_block_h(group: int) -> int:
    """Rows of the split kernel's query tile: the GROUP heads of one KV head, at least tl.dot's 16."""
    return max(16, triton.next_power_of_2(group))


# Column width of the fp8 cache's chunked tiles (`_attend_fp8_in_chunks`): four chunks make a 128-wide head.
FP8_CHUNK = tl.constexpr(32)


@triton.jit
def _attend_fp8_in_chunks(
    q_rows, row_valid, k_cache, v_cache, block_table_row, kv_head_offset, start, end, scale_log2,
    stride_cache_block, stride_cache_pos,
    BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    window_start=0,
):
    """The fp8 cache's tiles (float16 dots) over a 128-wide head as four 32-wide column chunks: q . k
    accumulates the chunks' dots in order (the whole-tile dot's k order), P V gives each output chunk
    alone. Why: the whole tile's upcast K and V live in registers at once (248 registers per thread,
    two programs per SM, the kernel bound by issue: `python launch/bench/bench_attention.py`); a chunk's do not
    (96 registers). Returns (acc [BLOCK_H, HEAD_DIM], l_i, m_i)."""
    dc = tl.arange(0, FP8_CHUNK)
    mask = row_valid[:, None]
    q0 = fp8_dot_operand(tl.load(q_rows + dc[None, :], mask=mask, other=0.0))
    q1 = fp8_dot_operand(tl.load(q_rows + FP8_CHUNK + dc[None, :], mask=mask, other=0.0))
    q2 = fp8_dot_operand(tl.load(q_rows + 2 * FP8_CHUNK + dc[None, :], mask=mask, other=0.0))
    q3 = fp8_dot_operand(tl.load(q_rows + 3 * FP8_CHUNK + dc[None, :], mask=mask, other=0.0))
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    a0 = tl.zeros([BLOCK_H, FP8_CHUNK], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_H, FP8_CHUNK], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_H, FP8_CHUNK], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_H, FP8_CHUNK], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        positions, valid, rows = paged_tile(block_table_row, tile_start, end, stride_cache_block, stride_cache_pos,
                                            BLOCK_SIZE, BLOCK_N)
        valid = valid & (positions >= window_start)
        k_chunks = k_cache + (rows[:, None] + kv_head_offset + dc[None, :])
        live = valid[:, None]
        scores = tl.dot(q0, tl.trans(tl.load(k_chunks, mask=live, other=0.0).to(tl.float16)))
        scores = tl.dot(q1, tl.trans(tl.load(k_chunks + FP8_CHUNK, mask=live, other=0.0).to(tl.float16)), scores)
        scores = tl.dot(q2, tl.trans(tl.load(k_chunks + 2 * FP8_CHUNK, mask=live, other=0.0).to(tl.float16)), scores)
        scores = tl.dot(q3, tl.trans(tl.load(k_chunks + 3 * FP8_CHUNK, mask=live, other=0.0).to(tl.float16)), scores)
        scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(scores, m_i, l_i)
        p = p.to(tl.float16)
        # V by pairs of positions (kv_quant.FP8_V_LAYOUT): a chunk is [BLOCK_N / 2, 2 * chunk] bytes
        pair_valid, pair_rows = fp8_v_pair_rows(block_table_row, tile_start, end, stride_cache_block,
                                                stride_cache_pos, BLOCK_SIZE, BLOCK_N)
        v_pairs = v_cache + (pair_rows[:, None] + 2 * kv_head_offset + tl.arange(0, 2 * FP8_CHUNK)[None, :])
        pair_live = pair_valid[:, None]
        a0 = a0 * alpha[:, None] + tl.dot(
            p, fp8_v_operand(tl.load(v_pairs, mask=pair_live, other=0.0), BLOCK_N, FP8_CHUNK))
        a1 = a1 * alpha[:, None] + tl.dot(
            p, fp8_v_operand(tl.load(v_pairs + 2 * FP8_CHUNK, mask=pair_live, other=0.0), BLOCK_N, FP8_CHUNK))
        a2 = a2 * alpha[:, None] + tl.dot(
            p, fp8_v_operand(tl.load(v_pairs + 4 * FP8_CHUNK, mask=pair_live, other=0.0), BLOCK_N, FP8_CHUNK))
        a3 = a3 * alpha[:, None] + tl.dot(
            p, fp8_v_operand(tl.load(v_pairs + 6 * FP8_CHUNK, mask=pair_live, other=0.0), BLOCK_N, FP8_CHUNK))
    # [BLOCK_H, chunk] x 4 -> [BLOCK_H, HEAD_DIM]: join gives [H, c, 2, 2] with a0 a1 / a2 a3 at (i, j) = c index 2i + j
    acc = tl.reshape(tl.permute(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (0, 2, 3, 1)), [BLOCK_H, HEAD_DIM])
    return acc, l_i, m_i


@triton.jit
def decode_split_program(
    seq, kv_head, split,
    query, k_cache, v_cache, out, partial_out, partial_lse, counters, seq_lens, block_tables, scale_log2,
    k_scale, v_scale,
    stride_q_seq, stride_q_head, stride_o_seq, stride_o_head,
    stride_cache_block, stride_cache_pos, stride_cache_head, stride_table,
    num_q_heads,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, num_splits, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    DOT_F16: tl.constexpr, FUSED_MERGE: tl.constexpr, WINDOW: tl.constexpr = 0, KV_INT8: tl.constexpr = False,
):
    """One (sequence, KV head, split) of the split kernel: shared with the mixed-batch kernel
    (kernels/mixed_attention.py), so a decode row computes the same bits in either launch. `num_splits`
    is the split kernel's constexpr NUM_SPLITS (a graph bucket compiles its own) or the mixed kernel's
    runtime int (one compiled kernel whatever the batch): only integer bounds follow from it. FUSED_MERGE
    (with several splits) has the last split to arrive merge them; off, the partials stay in `partial_out` /
    `partial_lse` for the tests' second-launch merge (tests/helpers/split_oracles.py). KV_INT8: an int8 cache
    (rows of int8 values and a float32 scale; q and the output in the rotated basis): the int8 values go into
    the dots exactly (|x| <= 127 in any 16-bit float), K's row scales multiply the scores, V's the weights p."""
    if KV_FP8:  # dequantization folded: q.(s_k k8) = s_k (q.k8), sum p (s_v v8) = s_v sum p v8
        scale_log2 = scale_log2 * tl.load(k_scale + kv_head)
    seq_len = tl.load(seq_lens + seq)
    # this split's BLOCK_N-aligned share of the sequence (on device: no host sync); with a window, of the tiles
    # from the one holding the window's first key
    window_start = 0
    first_tile = 0
    if WINDOW > 0:
        window_start = tl.maximum(seq_len - WINDOW, 0)
        first_tile = (window_start // BLOCK_N) * BLOCK_N
    split_len = tl.cdiv(seq_len - first_tile, num_splits * BLOCK_N) * BLOCK_N
    start = first_tile + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    group_rows = tl.arange(0, BLOCK_H)
    row_valid = group_rows < GROUP
    heads = kv_head * GROUP + group_rows
    dims = tl.arange(0, HEAD_DIM)
    q_rows = query + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head
    block_table_row = block_tables + seq.to(tl.int64) * stride_table
    kv_head_offset = kv_head.to(tl.int64) * stride_cache_head
    if DOT_F16 and HEAD_DIM == 4 * FP8_CHUNK:
        acc, l_i, m_i = _attend_fp8_in_chunks(
            q_rows, row_valid, k_cache, v_cache, block_table_row, kv_head_offset, start, end, scale_log2,
            stride_cache_block, stride_cache_pos, BLOCK_H, BLOCK_SIZE, HEAD_DIM, BLOCK_N, window_start,
        )
    else:
        q = tl.load(q_rows + dims[None, :], mask=row_valid[:, None], other=0.0)
        if DOT_F16:
            q = fp8_dot_operand(q)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
        for tile_start in range(start, end, BLOCK_N):
            positions, valid, rows = paged_tile(block_table_row, tile_start, end, stride_cache_block,
                                                stride_cache_pos, BLOCK_SIZE, BLOCK_N)
            if WINDOW > 0:
                valid = valid & (positions >= window_start)
            offsets = rows[:, None] + kv_head_offset + dims[None, :]
            k = tl.load(k_cache + offsets, mask=valid[:, None], other=0.0)
            if KV_FP8:  # pairs of positions (kv_quant.FP8_V_LAYOUT)
                offsets = fp8_v_rows(rows, positions, stride_cache_pos)[:, None] + 2 * (kv_head_offset + dims[None, :])
            v = tl.load(v_cache + offsets, mask=valid[:, None], other=0.0)
            if KV_FP8 and not DOT_F16:  # float32 model: upcast exactly, dot in float32
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
            if KV_INT8:  # q.(s_k k8) = s_k (q.k8); sum p (s_v v8) = sum (p s_v) v8
                scores = scores * int8_row_scales(k_cache, rows, kv_head_offset, valid, HEAD_DIM)[None, :]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            p, alpha, m_i, l_i = online_softmax_step(scores, m_i, l_i)
            if KV_INT8:
                p = p * int8_row_scales(v_cache, rows, kv_head_offset, valid, HEAD_DIM)[None, :]
            acc = acc * alpha[:, None] + tl.dot(
                p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION
            )

    empty = l_i == 0.0  # split past the sequence end (or an empty sequence)
    result = acc / tl.where(empty, 1.0, l_i)[:, None]
    if KV_FP8:
        result = result * tl.load(v_scale + kv_head)
    if num_splits == 1:
        tl.store(
            out + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head + dims[None, :],
            result.to(out.dtype.element_ty), mask=row_valid[:, None],
        )
    else:
        slot = (seq.to(tl.int64) * num_q_heads + heads) * num_splits + split  # [BLOCK_H]
        tl.store(partial_out + slot[:, None] * HEAD_DIM + dims[None, :], result, mask=row_valid[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(partial_lse + slot, lse, mask=row_valid)
        if FUSED_MERGE:
            tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
            counter = counters + seq * (num_q_heads // GROUP) + kv_head
            # release: this program's partials are visible to whoever sees the count; acquire: the last
            # arrival sees every other split's partials (read from L2 below, `.cg`)
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                slot0 = (seq.to(tl.int64) * num_q_heads + heads) * num_splits  # [BLOCK_H]
                # only the splits that hold keys: the count follows the table width (a graph's shape), the
                # context is often far shorter (batch 1, 4k table, 650 keys: 6 of 32), and the others weigh 0
                live = tl.where(seq_len > 0, tl.cdiv(seq_len - first_tile, tl.maximum(split_len, 1)), 1)
                merged = _merge_partials(
                    partial_out, partial_lse, slot0[:, None], row_valid[:, None], dims, live, HEAD_DIM
                )
                tl.store(
                    out + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head + dims[None, :],
                    merged.to(out.dtype.element_ty), mask=row_valid[:, None],
                )
                tl.store(counter, 0)  # ready for the next launch (and the next graph replay)


@triton.jit
def _decode_split_kernel(
    query, k_cache, v_cache, out, partial_out, partial_lse, counters, seq_lens, block_tables, scale_log2,
    k_scale, v_scale,
    stride_q_seq, stride_q_head, stride_o_seq, stride_o_head,
    stride_cache_block, stride_cache_pos, stride_cache_head, stride_table,
    num_q_heads,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    DOT_F16: tl.constexpr, FUSED_MERGE: tl.constexpr,
    USE_PDL: tl.constexpr, WINDOW: tl.constexpr = 0, KV_INT8: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    decode_split_program(
        tl.program_id(2), tl.program_id(1), tl.program_id(0),
        query, k_cache, v_cache, out, partial_out, partial_lse, counters, seq_lens, block_tables, scale_log2,
        k_scale, v_scale,
        stride_q_seq, stride_q_head, stride_o_seq, stride_o_head,
        stride_cache_block, stride_cache_pos, stride_cache_head, stride_table,
        num_q_heads,
        GROUP, BLOCK_H, BLOCK_SIZE, HEAD_DIM, BLOCK_N, NUM_SPLITS, DOT_PRECISION, KV_FP8, DOT_F16, FUSED_MERGE,
        WINDOW, KV_INT8,
    )


@triton.jit(do_not_specialize=["num_splits"])
def _decode_any_splits_kernel(
    query, k_cache, v_cache, out, partial_out, partial_lse, counters, seq_lens, block_tables, scale_log2,
    k_scale, v_scale,
    stride_q_seq, stride_q_head, stride_o_seq, stride_o_head,
    stride_cache_block, stride_cache_pos, stride_cache_head, stride_table,
    num_q_heads, num_splits,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, DOT_F16: tl.constexpr,
    USE_PDL: tl.constexpr, WINDOW: tl.constexpr = 0, KV_INT8: tl.constexpr = False,
):
    """The split kernel with the split count a runtime int and the splits merging themselves: one compiled
    kernel for every count. Why: the decode rows of a mixed step launched apart from its prompt chunks (a
    decode config whose warps differ from the prefill's) have a count that follows the step's decode rows;
    a constexpr count compiled a kernel per count in the middle of a job (~1 s each). Same bits as
    `_decode_split_kernel` (only integer bounds follow from the count). `partial_out`/`partial_lse` are
    always the float32 partials, whatever the count (pointer types are specialised on)."""
    pdl_prologue(USE_PDL)
    decode_split_program(
        tl.program_id(2), tl.program_id(1), tl.program_id(0),
        query, k_cache, v_cache, out, partial_out, partial_lse, counters, seq_lens, block_tables, scale_log2,
        k_scale, v_scale,
        stride_q_seq, stride_q_head, stride_o_seq, stride_o_head,
        stride_cache_block, stride_cache_pos, stride_cache_head, stride_table,
        num_q_heads,
        GROUP, BLOCK_H, BLOCK_SIZE, HEAD_DIM, BLOCK_N, num_splits, DOT_PRECISION, KV_FP8, DOT_F16, True, WINDOW,
        KV_INT8,
    )


@triton.jit
def _merge_partials(
    partial_out, partial_lse, slot0, row_mask, dims, num_splits, HEAD_DIM: tl.constexpr
):
    """Rows slot0 [R, 1] (split 0's slot; splits follow it) merged into [R, HEAD_DIM] float32, weighted
    by the splits' log-sum-exps. Why element-wise steps in split order, not tl.max/tl.sum over a splits
    axis: a reduction's order follows the compiler's layout (tile shape, num_warps), and the merge runs
    under the split kernel's warps; in this order the tests' second-launch merge, under its own warps,
    gives the same bits. Loads are `.cg` (L2): never a stale L1 line of a partial
    another program stored. `num_splits` may stop at the last split that holds keys (the fused merge):
    a split past the sequence end has log-sum-exp -inf, weight exactly 0, and adds +0 to the sums,
    which leaves them as they are (the sums start at +0 and never become -0), so the bits are the same."""
    lse_max = tl.load(partial_lse + slot0, mask=row_mask, other=float("-inf"), cache_modifier=".cg")
    for s in range(1, num_splits):
        lse_max = tl.maximum(
            lse_max, tl.load(partial_lse + slot0 + s, mask=row_mask, other=float("-inf"), cache_modifier=".cg")
        )
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty: weights 0
    total = tl.zeros_like(lse_max)
    acc = tl.zeros([slot0.shape[0], HEAD_DIM], dtype=tl.float32)
    for s in range(num_splits):
        lse = tl.load(partial_lse + slot0 + s, mask=row_mask, other=float("-inf"), cache_modifier=".cg")
        weight = tl.exp2(lse - lse_max)
        total += weight
        partial = tl.load(
            partial_out + (slot0 + s) * HEAD_DIM + dims[None, :], mask=row_mask, other=0.0, cache_modifier=".cg"
        )
        acc += partial * weight
    return acc / tl.where(total == 0.0, 1.0, total)


def paged_decode_attention(
    query: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, M] int32
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    k_scale: torch.Tensor | None = None,  # [Hkv] float32, only with a float8_e4m3fn cache
    v_scale: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Attention of each sequence's single new token over its seq_len cached keys; returns [B, Hq, D].
    `window` > 0: over its last `window` keys only (a sliding window). An int8 cache ([N, bs, Hkv, D + 4]) holds
    rotated rows: `query` and the result are in the rotated basis (kernels/kv_int8.py rotates them).

    With several splits the last split of each (sequence, KV head) to arrive merges them (counters from
    `merge_counters`, allocated outside graph capture by the first eager call)."""
    check_attention_inputs("paged_decode_attention", query, k_cache, v_cache)
    kv_fp8 = check_kv_scales("paged_decode_attention", k_cache, k_scale, v_scale)
    num_seqs, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    if out.stride(2) != 1:
        raise ValueError("paged_decode_attention: out must have a contiguous head_dim")
    cfg = config or default_decode_config(head_dim, query.device, kv_fp8)
    num_splits = split_count("paged_decode_attention", num_splits, num_seqs, k_cache, block_tables, cfg, window)
    group = num_q_heads // num_kv_heads
    partial_out, partial_lse = _split_partials(query, out, num_splits)
    fused = num_splits > 1  # one split writes `out` itself
    counters = merge_counters(query.device, num_seqs * num_kv_heads) if fused else seq_lens  # unread with one split
    _decode_split_kernel[(num_splits, num_kv_heads, num_seqs)](
        query, k_cache, v_cache, out, partial_out, partial_lse, counters, seq_lens, block_tables,
        scale * _LOG2_E,
        k_scale if kv_fp8 else seq_lens, v_scale if kv_fp8 else seq_lens,  # unread without KV_FP8
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_q_heads,
        GROUP=group, BLOCK_H=decode_block_h(group), BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, BLOCK_N=cfg.block_n, NUM_SPLITS=num_splits,
        DOT_PRECISION=dot_precision(query.dtype), KV_FP8=kv_fp8, DOT_F16=fp8_dot_in_f16(kv_fp8, query.dtype),
        FUSED_MERGE=fused, WINDOW=window, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_launch(query.device), **({"KV_INT8": True} if is_int8_cache(k_cache) else {}),
    )
    return out


def _split_partials(query: torch.Tensor, out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 per-split outputs [B, Hq, S, D] and log-sum-exps [B, Hq, S] for the merge; with one
    split the kernel writes `out` directly and never reads them (`out` stands in for both)."""
    if num_splits == 1:
        return out, out
    num_seqs, num_q_heads, head_dim = query.shape
    partial_out = torch.empty(num_seqs, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    partial_lse = torch.empty(num_seqs, num_q_heads, num_splits, dtype=torch.float32, device=query.device)
    return partial_out, partial_lse


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # kept alive: CUDA graphs captured earlier still point at them


def merge_counters(device: torch.device, count: int = 0) -> torch.Tensor:
    """The device's zeroed int32 arrival counters, at least `count` of them (every fused launch leaves
    them zero). Owned here, one buffer per device shared by every layer and call (they run one after
    another on one stream), so a CUDA graph bakes in a pointer that stays valid: allocated once, at
    least MIN_COUNTERS, grown only outside capture (the engine's eager warm-ups precede each capture)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"paged_decode_attention: {count} merge counters must be allocated before "
                               "CUDA-graph capture (run the step once eagerly first)")
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = torch.zeros(max(count, MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters
