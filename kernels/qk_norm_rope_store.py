"""One launch per layer from the qkv projection to the paged KV cache: (Qwen3) per-head RMSNorm of q and
k, rotary on q and k, q written out for attention, rotated k and v stored at `slot_mapping`.

Replaces `rms_norm_pair` + `apply_rotary` twice + `store_kv` (four launches of ~1.4 us each per layer at
batch 1, and a pair kernel of one 1-warp program per (token, head) at thousands of tokens) with the same
bits: every rounding of the unfused chain is kept (the norm rounded to the model dtype before its weight,
the normed q/k rounded to the model dtype, rotary in float32 rounded once, k/v quantized to
float8_e4m3fn exactly as `kernels/kv_store.py` does it).

Layout: grid (tokens, head groups). A group is ROWS heads, one warp per head (num_warps == ROWS): the
first ceil(Hq / ROWS) groups are q's, the rest each store ROWS k heads and ROWS v heads of one token
(skipped for slot -1). A head's RMSNorm sum is a row of a [ROWS, D] tile over ROWS warps, so each warp
reduces one row exactly as `_rms_norm_pair_kernel`'s single warp reduces its [D] vector (D <= 256):
the same per-thread split and lane tree, hence the same float32 sum. At batch 1 ROWS is 1 (Hq + Hkv
programs, one short launch); at thousands of tokens it grows to 8 (fewer, fuller programs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.kv_quant import check_kv_scales
from spmd_engine.kernels.kv_store import _check_store_shapes, _round_to_e4m3

MAX_NORM_HEAD_DIM = 256  # rms_norm_pair reduces a head in one warp up to here; beyond, its 4 warps would differ


@triton.jit
def _norm_rope_halves(
    x, heads, num_heads, stride_head, weight, cos_row, sin_row, num_cols, half, eps,
    HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Rows `heads` [ROWS, 1] of one token's x -> its rotated halves, each [ROWS, BLOCK_HALF] in x's dtype."""
    dtype = x.dtype.element_ty
    row_ok = heads < num_heads
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    half_ok = row_ok & (dims < half)
    base = x + heads * stride_head
    c = tl.load(cos_row + dims, mask=dims < half, other=0.0).to(tl.float32)
    s = tl.load(sin_row + dims, mask=dims < half, other=0.0).to(tl.float32)
    x1 = tl.load(base + dims, mask=half_ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + dims, mask=half_ok, other=0.0).to(tl.float32)
    if HAS_NORM:  # rms_norm.py `_normalize`, the sum over the whole row as its one-warp reduction takes it
        cols = tl.arange(0, BLOCK_D)[None, :]
        row = tl.load(base + cols, mask=row_ok & (cols < num_cols), other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(row * row, axis=1) / num_cols + eps)[:, None]
        w1 = tl.load(weight + dims, mask=dims < half, other=0.0).to(tl.float32)
        w2 = tl.load(weight + half + dims, mask=dims < half, other=0.0).to(tl.float32)
        x1 = (((x1 * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype)).to(tl.float32)
        x2 = (((x2 * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype)).to(tl.float32)
    # rotary.py `_rotary_kernel`'s expressions, term for term (the same float32 contractions)
    out1 = (x1 * c - x2 * s).to(dtype)
    out2 = (x2 * c + x1 * s).to(dtype)
    return out1, out2


@triton.jit
def _to_cache(x, scale_ptr, heads, row_ok, cache_dtype: tl.constexpr, QUANTIZE: tl.constexpr):
    """kv_store.py's conversion: x / scale rounded to e4m3 (IEEE division), or a plain cast."""
    if QUANTIZE:
        scale = tl.load(scale_ptr + heads, mask=row_ok, other=1.0)
        x = _round_to_e4m3(tl.math.div_rn(x.to(tl.float32), scale))
    return x.to(cache_dtype)


@triton.jit
def _qk_norm_rope_store_kernel(
    q, k, v, cos, sin, q_weight, k_weight, q_out, k_cache, v_cache, slot_mapping, k_scale, v_scale,
    num_q_heads, num_kv_heads, num_cols, half, eps,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_cs_tok,
    stride_cache_block, stride_cache_pos, stride_cache_head, block_size,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr, QUANTIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    q_groups = tl.cdiv(num_q_heads, ROWS)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos_row, sin_row = cos + tok * stride_cs_tok, sin + tok * stride_cs_tok
    if group < q_groups:
        heads = group * ROWS + tl.arange(0, ROWS)[:, None]
        out1, out2 = _norm_rope_halves(q + tok * stride_q_tok, heads, num_q_heads, stride_q_head, q_weight,
                                       cos_row, sin_row, num_cols, half, eps, HAS_NORM, BLOCK_D, BLOCK_HALF)
        mask = (heads < num_q_heads) & (dims < half)
        dst = q_out + (tok * num_q_heads + heads) * num_cols + dims
        tl.store(dst, out1, mask=mask)
        tl.store(dst + half, out2, mask=mask)
    else:  # the loads do not wait for the slot (one memory round trip less at batch 1); slot -1 stores nothing
        heads = (group - q_groups) * ROWS + tl.arange(0, ROWS)[:, None]
        out1, out2 = _norm_rope_halves(k + tok * stride_k_tok, heads, num_kv_heads, stride_k_head, k_weight,
                                       cos_row, sin_row, num_cols, half, eps, HAS_NORM, BLOCK_D, BLOCK_HALF)
        cols = tl.arange(0, BLOCK_D)[None, :]
        values = tl.load(v + tok * stride_v_tok + heads * stride_v_head + cols,
                         mask=(heads < num_kv_heads) & (cols < num_cols))
        slot = tl.load(slot_mapping + tok + 0 * heads).to(tl.int64)  # [ROWS, 1]: the token's slot in every row
        row_ok = (heads < num_kv_heads) & (slot >= 0)
        slot = tl.maximum(slot, 0)
        cache_row = (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_pos
        cache_row = cache_row + heads * stride_cache_head
        mask = row_ok & (dims < half)
        cache_dtype = k_cache.dtype.element_ty
        tl.store(k_cache + cache_row + dims, _to_cache(out1, k_scale, heads, row_ok, cache_dtype, QUANTIZE), mask=mask)
        tl.store(k_cache + cache_row + half + dims, _to_cache(out2, k_scale, heads, row_ok, cache_dtype, QUANTIZE),
                 mask=mask)
        tl.store(v_cache + cache_row + cols, _to_cache(values, v_scale, heads, row_ok, cache_dtype, QUANTIZE),
                 mask=row_ok & (cols < num_cols))

def rows_per_program(num_tokens: int, num_q_heads: int, num_kv_heads: int, on_device: bool) -> int:
    """Heads per program (and warps): 1 while the grid is small (batch 1: one program per head, all in
    flight at once), up to 8 once ~1000+ programs remain (large token counts: fewer, fuller programs).
    Under TRITON_INTERPRET (CPU tensors) every head of a kind in one program: the interpreter runs
    programs one by one, and the bits do not depend on it."""
    widest = triton.next_power_of_2(max(num_q_heads, num_kv_heads))
    if not on_device:
        return widest
    rows = 1
    while rows < min(8, widest) and num_tokens * (num_q_heads + num_kv_heads) >= 1024 * 2 * rows:
        rows *= 2
    return rows


def can_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             has_norm: bool) -> bool:
    """Whether `qk_norm_rope_store` takes these views as they are (otherwise the caller runs the parts)."""
    head_dim = q.shape[-1]
    return (q.dim() == k.dim() == v.dim() == 3 and q.stride(2) == k.stride(2) == v.stride(2) == 1
            and head_dim % 2 == 0 and k.shape[-1] == head_dim and cos.stride() == sin.stride()
            and cos.dim() == 2 and cos.stride(1) == 1
            and (not has_norm or triton.next_power_of_2(head_dim) <= MAX_NORM_HEAD_DIM))


def qk_norm_rope_store(
    q: torch.Tensor,  # [T, Hq, D], last dim contiguous (a strided slice of the qkv projection output)
    k: torch.Tensor,  # [T, Hkv, D], same
    v: torch.Tensor,  # [T, Hkv, D], same
    cos: torch.Tensor,  # [T, D/2], last dim contiguous (the model dtype, as LlamaModel.embed makes it)
    sin: torch.Tensor,  # [T, D/2], cos's strides
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int32/int64; -1 = padding, not stored
    q_weight: torch.Tensor | None = None,  # [D] per-head RMSNorm weights (Qwen3); None: no norm (Llama)
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    k_scale: torch.Tensor | None = None,  # [Hkv] float32, only with a float8_e4m3fn cache
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """rotary(norm(q)) -> [T, Hq, D] contiguous in q's dtype; rotary(norm(k)) and v written into the cache.
    The same bits as rms_norm_pair, apply_rotary on q and on k, then store_kv."""
    has_norm = q_weight is not None
    if (k_weight is not None) != has_norm:
        raise ValueError("qk_norm_rope_store: q_weight and k_weight come together")
    if not can_fuse(q, k, v, cos, sin, has_norm):
        raise ValueError(f"qk_norm_rope_store: q/k/v must be [T, H, D] with a contiguous last dim and even D "
                         f"(<= {MAX_NORM_HEAD_DIM} with norms), cos/sin [T, D/2] with equal strides; got q "
                         f"{tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} cos {tuple(cos.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    half = head_dim // 2
    if k.shape[0] != num_tokens or q.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"qk_norm_rope_store: q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} "
                         f"must share tokens and dtype")
    if cos.shape != (num_tokens, half) or sin.shape != cos.shape:
        raise ValueError(f"qk_norm_rope_store: cos/sin must be [{num_tokens}, {half}], got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    if has_norm and (q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,)):
        raise ValueError(f"qk_norm_rope_store: norm weights must be [{head_dim}], got {tuple(q_weight.shape)}, "
                         f"{tuple(k_weight.shape)}")
    _check_store_shapes(k, v, k_cache, v_cache, slot_mapping)
    quantize = check_kv_scales("qk_norm_rope_store", k_cache, k_scale, v_scale)
    if k_cache.stride(3) != 1:
        raise ValueError("qk_norm_rope_store: k_cache/v_cache head_dim must be contiguous")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    num_kv_heads = k.shape[1]
    rows = rows_per_program(num_tokens, num_q_heads, num_kv_heads, q.is_cuda)
    groups = triton.cdiv(num_q_heads, rows) + triton.cdiv(num_kv_heads, rows)
    _qk_norm_rope_store_kernel[(num_tokens, groups)](
        q, k, v, cos, sin,
        q_weight if has_norm else q, k_weight if has_norm else q,  # unread without HAS_NORM
        q_out, k_cache, v_cache, slot_mapping,
        k_scale if quantize else slot_mapping, v_scale if quantize else slot_mapping,  # unread without QUANTIZE
        num_q_heads, num_kv_heads, head_dim, half, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1],
        ROWS=rows, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_HALF=triton.next_power_of_2(half),
        HAS_NORM=has_norm, QUANTIZE=quantize, num_warps=rows,
    )
    return q_out
