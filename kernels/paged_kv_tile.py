"""Address a tile of BLOCK_N consecutive KV positions of one sequence through its block table, the
running-softmax step over it, and the float16 operand of the fp8-cache dots.

Shared by the prefill and decode kernels. When a KV block holds at least a whole tile (tiles are
BLOCK_N-aligned), one scalar block-id load serves the tile; smaller blocks gather an id per row.
"""
from __future__ import annotations

import triton
import triton.language as tl

from spmd_engine.kernels.kv_quant import FP8_MAX

E4M3_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def paged_tile_offsets(
    block_table_row,  # pointer to this sequence's block-table row
    tile_start,  # first KV position of the tile (a multiple of BLOCK_N)
    positions,  # [BLOCK_N] KV positions tile_start + arange(BLOCK_N)
    valid,  # [BLOCK_N] bool: position < sequence length (rows past it are never read)
    stride_block,  # cache stride between blocks (elements)
    stride_pos,  # cache stride between positions inside a block (elements)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """[BLOCK_N] int64 element offsets of the tile's rows in a [N, BLOCK_SIZE, Hkv, D] cache.

    The positions divide as unsigned ints: they are never negative, but the compiler cannot know it
    where a tile starts at a runtime offset (a decode split's start), and a signed // and % by the
    block size each take a sign fix-up per element. Same offsets; compiled for sm_90 (Triton 3.6, head
    128, block 16) the decode kernel's loop went from 809 to 661 instructions per 128-key tile in bf16
    and from 1,011 to 934 with an fp8 cache, the prefill kernel's from 677 to 618 (SASS of
    the compiled kernels). On the H200 bf16 decode steps gained 0.4 %; the fp8 loop of the plain V layout lost 6 %
    (its registers fell 104 -> 96: five programs per SM instead of four), but with V in pairs of positions
    it has 96 either way and signed or unsigned time the same (148.5 / 148.4 us per launch;
    `python launch/bench/bench_attention.py`)."""
    unsigned = positions.to(tl.uint32)
    slots = (unsigned % BLOCK_SIZE).to(tl.int64) * stride_pos
    if BLOCK_SIZE >= BLOCK_N:
        block_id = tl.load(block_table_row + tl.cast(tile_start, tl.uint32) // BLOCK_SIZE).to(tl.int64)
        return block_id * stride_block + slots
    else:
        block_ids = tl.load(block_table_row + unsigned // BLOCK_SIZE, mask=valid, other=0)
        return block_ids.to(tl.int64) * stride_block + slots


@triton.jit
def paged_tile(
    block_table_row, tile_start, end, stride_block, stride_pos, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The tile at `tile_start` of a sequence whose first `end` positions are read: (positions, valid,
    row offsets), the three every attention loop starts a tile with."""
    positions = tile_start + tl.arange(0, BLOCK_N)
    valid = positions < end
    rows = paged_tile_offsets(block_table_row, tile_start, positions, valid, stride_block, stride_pos,
                              BLOCK_SIZE, BLOCK_N)
    return positions, valid, rows


@triton.jit
def fp8_v_offset(offset, head_dim_offset, stride_pos):
    """Element offset, from its block's start, of position `offset` (in the block) at `head_dim_offset`
    (head * stride_head + dim) in an fp8 V cache, which stores pairs of positions (`kv_quant.FP8_V_LAYOUT`):
    the pair's two values of a (head, dim) side by side."""
    return (offset - offset % 2) * stride_pos + offset % 2 + 2 * head_dim_offset


@triton.jit
def fp8_v_rows(rows, positions, stride_pos):
    """`paged_tile`'s row offsets turned into an fp8 V cache's (pairs of positions); a row's (head, dim)
    offset then counts twice: add 2 * (head * stride_head + dim)."""
    return rows + (positions % 2) * (1 - stride_pos)


@triton.jit
def fp8_v_pair_rows(
    block_table_row, tile_start, end, stride_block, stride_pos, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The tile's pairs of positions in an fp8 V cache (`kv_quant.FP8_V_LAYOUT`): (valid [BLOCK_N / 2], the
    pair rows' element offsets [BLOCK_N / 2]). A pair row of one head is contiguous (2 * head_dim values,
    from 2 * (head * stride_head)). A pair is valid when its first position is (< end): a pair is whole or
    past the end, but for an odd end's partner, which `fp8_v_operand` makes finite."""
    pair_positions = tile_start + 2 * tl.arange(0, BLOCK_N // 2)
    valid = pair_positions < end
    rows = paged_tile_offsets(block_table_row, tile_start, pair_positions, valid, stride_block, stride_pos,
                              BLOCK_SIZE, BLOCK_N)
    return valid, rows


@triton.jit
def fp8_v_operand(pairs, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr):
    """V pair rows [BLOCK_N / 2, 2 * WIDTH] (float8) -> [BLOCK_N, WIDTH] float16, the P.V dot's operand,
    whose registers hold exactly such pairs (no byte shuffle). An e4m3 NaN byte (an odd end's partner: a
    stale or never written slot; its p is 0 but 0 * NaN is NaN) becomes 448 by a min, which leaves every
    finite e4m3 value as it is (|x| <= 448) for one instruction per pair (masking by position sent the tile
    through shared memory). The GPU's min returns the non-NaN operand; TRITON_INTERPRET's propagates NaN."""
    x = tl.permute(tl.reshape(pairs, [BLOCK_N // 2, WIDTH, 2]), (0, 2, 1))
    x = tl.reshape(x, [BLOCK_N, WIDTH]).to(tl.float16)
    return tl.minimum(x, tl.full([BLOCK_N, WIDTH], E4M3_MAX, tl.float16))


@triton.jit
def int8_row_scales(cache, rows, kv_head_offset, valid, HEAD_DIM: tl.constexpr):
    """An int8 cache's (`kv_cache_dtype=int8`) float32 scales [BLOCK_N] of the tile's rows of one KV head: the 4
    bytes after each row's HEAD_DIM values, read through a float32 pointer (rows are 4-byte aligned: HEAD_DIM + 4
    wide). 0 where not valid (never-written bytes are not read)."""
    scales = (cache + rows + kv_head_offset + HEAD_DIM).to(tl.pointer_type(tl.float32), bitcast=True)
    return tl.load(scales, mask=valid, other=0.0)


@triton.jit
def online_softmax_step(scores, m_i, l_i):
    """One tile of the running softmax over log2-scaled scores [rows, BLOCK_N] (-inf where not visible):
    (p, the rescale of what came before, the new row max, the new row sum)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


FP16_MAX = tl.constexpr(65504.0)


def fp8_dot_in_f16(kv_fp8: bool, dtype) -> bool:
    """A float8 cache under a 16-bit model: attend in float16 (e4m3 -> f16 is one hardware convert per
    two values and exact; the e4m3 -> f32 -> bf16 route costs three and made the fp8 decode no faster
    than bf16). float16 also keeps more of q's bits than bfloat16. A float32 model stays in float32."""
    import torch

    return kv_fp8 and dtype != torch.float32


@triton.jit
def fp8_dot_operand(q):
    """q as the float16 operand of the fp8-cache dots (clamped: a bf16 value past float16's range would
    become inf and the softmax NaN)."""
    return tl.minimum(tl.maximum(q.to(tl.float32), -FP16_MAX), FP16_MAX).to(tl.float16)
