"""One launch per layer from the qkv projection to the paged KV cache: (Qwen3) per-head RMSNorm of q and
k, rotary on q and k, q written out for attention, rotated k and v stored at `slot_mapping`.

Replaces `rms_norm_pair` + `apply_rotary` twice + `store_kv` (four launches of ~1.4 us each per layer at
batch 1, and a pair kernel of one 1-warp program per (token, head) at thousands of tokens) with the same
bits: every rounding of the unfused chain is kept (the norm rounded to the model dtype before its weight,
the normed q/k rounded to the model dtype, rotary in float32 rounded once, k/v quantized to
float8_e4m3fn exactly as `kernels/kv_store.py` does it).

Layout: grid (tokens, head groups). A group is ROWS heads, one warp per head (num_warps == ROWS): the
first ceil(Hq / ROWS) groups are q's, the rest each store ROWS k heads and ROWS v heads of one token
(nothing for slot -1). At batch 1 ROWS is 1 (Hq + Hkv programs, one short launch); at thousands of tokens
it grows to 8 (fewer, fuller programs).

Bit-exactness on the GPU hinges on the norm's float32 sum, whose order follows the compiled layout. So
the norm is its own phase, as `_rms_norm_pair_kernel` is its own kernel: every tensor of it is a
[ROWS, D] tile (weights included) with no other layout to meet, which gives each warp one row split
over its 32 lanes exactly as the pair kernel's single warp splits its [D] vector (D <= 256): the same
per-thread chunks and lane tree, the same sum. The normed rows go through memory (q's into q_out, k's
into a scratch buffer; a CTA barrier orders the phases) and the rotary phase is `_rotary_kernel`'s code
term for term (the same float32 contractions).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.kv_quant import check_kv_scales
from spmd_engine.kernels.kv_store import _check_store_shapes, _round_to_e4m3
from spmd_engine.kernels.paged_kv_tile import fp8_v_offset
from spmd_engine.kernels.pdl import pdl_launch, pdl_prologue

MAX_NORM_HEAD_DIM = 256  # rms_norm_pair reduces a head in one warp up to here; beyond, its 4 warps would differ


@triton.jit
def _norm_rows(x, stride_head, weight, out, heads, num_heads, num_cols, eps, BLOCK_D: tl.constexpr):
    """rms_norm.py `_normalize` of rows `heads` [ROWS, 1] of one token's x into `out` (rows of num_cols)."""
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (cols < num_cols)
    values = tl.load(x + heads * stride_head + cols, mask=mask, other=0.0)
    w = tl.load(weight + 0 * heads + cols, mask=mask, other=0.0)  # a full tile: no second layout in this phase
    xf = values.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / num_cols + eps)
    normed = (xf * inv_rms[:, None]).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + heads * num_cols + cols, (normed * w.to(tl.float32)).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _cos_sin(cos, sin, tok, stride_cs_tok, half, BLOCK_HALF: tl.constexpr):
    """The token's cos and sin [1, BLOCK_HALF] in float32 (loaded first: the phases need not wait for them)."""
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    c = tl.load(cos + tok * stride_cs_tok + dims, mask=dims < half, other=0.0).to(tl.float32)
    s = tl.load(sin + tok * stride_cs_tok + dims, mask=dims < half, other=0.0).to(tl.float32)
    return c, s


@triton.jit
def _rotate_rows(x, stride_head, c, s, heads, num_heads, half, BLOCK_HALF: tl.constexpr):
    """rotary.py `_rotary_kernel` on rows `heads` of one token's x -> the two rotated halves in x's dtype."""
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    base = x + heads * stride_head + dims
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    return (x1 * c - x2 * s).to(x.dtype.element_ty), (x2 * c + x1 * s).to(x.dtype.element_ty)


@triton.jit
def _to_cache(x, scale_ptr, heads, row_ok, cache_dtype: tl.constexpr, QUANTIZE: tl.constexpr):
    """kv_store.py's conversion: x / scale rounded to e4m3 (IEEE division), or a plain cast."""
    if QUANTIZE:
        scale = tl.load(scale_ptr + heads, mask=row_ok, other=1.0)
        x = _round_to_e4m3(tl.math.div_rn(x.to(tl.float32), scale))
    return x.to(cache_dtype)


@triton.jit
def rotate_q_rows(
    q_tok, stride_q_head, q_weight, normed_row, rot_row, c, s, heads, num_heads, num_cols, half, eps,
    HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """q rows `heads` [ROWS, 1] (those < num_heads) of one token: (norm into normed_row, then) rotary into
    rot_row, rows of num_cols. normed_row may be rot_row (rotated in place: a barrier between)."""
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    if HAS_NORM:
        _norm_rows(q_tok, stride_q_head, q_weight, normed_row, heads, num_heads, num_cols, eps, BLOCK_D)
        tl.debug_barrier()
        out1, out2 = _rotate_rows(normed_row, num_cols, c, s, heads, num_heads, half, BLOCK_HALF)
        tl.debug_barrier()  # every normed value read before any is overwritten
    else:
        out1, out2 = _rotate_rows(q_tok, stride_q_head, c, s, heads, num_heads, half, BLOCK_HALF)
    mask = (heads < num_heads) & (dims < half)
    dst = rot_row + heads * num_cols + dims
    tl.store(dst, out1, mask=mask)
    tl.store(dst + half, out2, mask=mask)


@triton.jit
def store_kv_rows(
    k_tok, stride_k_head, v_tok, stride_v_head, k_weight, normed_row, slot_ptr, c, s, heads, num_heads, num_cols,
    half, eps, k_cache, v_cache, k_scale, v_scale, stride_cache_block, stride_cache_pos, stride_cache_head,
    block_size,
    HAS_NORM: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """k rows `heads` [ROWS, 1] (those < num_heads) of one token (norm through normed_row) rotated, and its v
    rows, stored at the token's slot (`slot_ptr`; -1 stores nothing). v and the slot are loaded first,
    nothing waits on the slot (batch 1 latency)."""
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cols = tl.arange(0, BLOCK_D)[None, :]
    values = tl.load(v_tok + heads * stride_v_head + cols, mask=(heads < num_heads) & (cols < num_cols))
    slot = tl.load(slot_ptr + 0 * heads).to(tl.int64)  # [ROWS, 1]: the token's slot in every row
    if HAS_NORM:
        _norm_rows(k_tok, stride_k_head, k_weight, normed_row, heads, num_heads, num_cols, eps, BLOCK_D)
        tl.debug_barrier()
        out1, out2 = _rotate_rows(normed_row, num_cols, c, s, heads, num_heads, half, BLOCK_HALF)
    else:
        out1, out2 = _rotate_rows(k_tok, stride_k_head, c, s, heads, num_heads, half, BLOCK_HALF)
    row_ok = (heads < num_heads) & (slot >= 0)
    slot = tl.maximum(slot, 0)
    cache_row = (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_pos
    cache_row = cache_row + heads * stride_cache_head
    mask = row_ok & (dims < half)
    cache_dtype = k_cache.dtype.element_ty
    tl.store(k_cache + cache_row + dims, _to_cache(out1, k_scale, heads, row_ok, cache_dtype, QUANTIZE), mask=mask)
    tl.store(k_cache + cache_row + half + dims, _to_cache(out2, k_scale, heads, row_ok, cache_dtype, QUANTIZE),
             mask=mask)
    if QUANTIZE:  # an fp8 V cache stores pairs of positions (kv_quant.FP8_V_LAYOUT)
        block = (slot // block_size) * stride_cache_block
        v_dst = v_cache + block + fp8_v_offset(slot % block_size, heads * stride_cache_head + cols, stride_cache_pos)
    else:
        v_dst = v_cache + cache_row + cols
    tl.store(v_dst, _to_cache(values, v_scale, heads, row_ok, cache_dtype, QUANTIZE), mask=row_ok & (cols < num_cols))


@triton.jit
def _qk_norm_rope_store_kernel(
    q, k, v, cos, sin, q_weight, k_weight, q_out, k_normed, k_cache, v_cache, slot_mapping, k_scale, v_scale,
    num_q_heads, num_kv_heads, num_cols, half, eps,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_cs_tok,
    stride_cache_block, stride_cache_pos, stride_cache_head, block_size,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr, QUANTIZE: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    tok = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    q_groups = tl.cdiv(num_q_heads, ROWS)
    c, s = _cos_sin(cos, sin, tok, stride_cs_tok, half, BLOCK_HALF)
    if group < q_groups:  # normed q into q_out, rotated there in place
        heads = group * ROWS + tl.arange(0, ROWS)[:, None]
        out_row = q_out + tok * num_q_heads * num_cols
        rotate_q_rows(q + tok * stride_q_tok, stride_q_head, q_weight, out_row, out_row, c, s, heads, num_q_heads,
                      num_cols, half, eps, HAS_NORM, BLOCK_D, BLOCK_HALF)
    else:
        heads = (group - q_groups) * ROWS + tl.arange(0, ROWS)[:, None]
        store_kv_rows(k + tok * stride_k_tok, stride_k_head, v + tok * stride_v_tok, stride_v_head, k_weight,
                      k_normed + tok * num_kv_heads * num_cols, slot_mapping + tok, c, s, heads, num_kv_heads,
                      num_cols, half, eps, k_cache, v_cache, k_scale, v_scale, stride_cache_block,
                      stride_cache_pos, stride_cache_head, block_size, HAS_NORM, QUANTIZE, BLOCK_D, BLOCK_HALF)


def rows_per_program(num_tokens: int, num_q_heads: int, num_kv_heads: int, on_device: bool,
                     row_bytes: int = 0) -> int:
    """Heads per program (and warps): 1 while the grid is small (batch 1: one program per head, all in
    flight at once), up to 8 once ~1000+ programs remain (large token counts: fewer, fuller programs).
    A padded head row (`row_bytes`) over 512 bytes (float32 at D = 256) stays 1: 32 lanes of 16-byte
    chunks no longer span it, and with more warps than one a row would be split across two of them,
    unlike rms_norm_pair's single warp. Under TRITON_INTERPRET (CPU tensors) every head of a kind in one
    program: the interpreter runs programs one by one, and the bits do not depend on it."""
    widest = triton.next_power_of_2(max(num_q_heads, num_kv_heads))
    if not on_device:
        return widest
    rows = 1
    if row_bytes > 32 * 16:
        return rows
    while rows < min(8, widest) and num_tokens * (num_q_heads + num_kv_heads) >= 1024 * 2 * rows:
        rows *= 2
    return rows


def can_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             has_norm: bool) -> bool:
    """Whether `qk_norm_rope_store` takes these views as they are (otherwise the caller runs the parts).
    A float32 model on CUDA keeps the separate kernels: on the H200 the fused kernel's float32 results
    differ from theirs in the last bits (no rounding to a 16-bit type hides the compiler's other
    contraction of the rotary / norm arithmetic), and the fusion must not change a token."""
    head_dim = q.shape[-1]
    return ((q.dtype != torch.float32 or q.device.type != "cuda") and q.dim() == k.dim() == v.dim() == 3
            and q.stride(2) == k.stride(2) == v.stride(2) == 1
            and head_dim % 2 == 0 and k.shape[-1] == head_dim and cos.stride() == sin.stride()
            and cos.dim() == 2 and cos.stride(1) == 1
            and (not has_norm or triton.next_power_of_2(head_dim) <= MAX_NORM_HEAD_DIM))


def check_qk_inputs(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None) -> bool:
    """One clear line naming the field when the q/k/v views, rotary tables, norm weights or cache do not fit
    (this kernel and decode_rotary_attention's prologue); returns whether there are norms."""
    has_norm = q_weight is not None
    if (k_weight is not None) != has_norm:
        raise ValueError(f"{kernel}: q_weight and k_weight come together")
    if not can_fuse(q, k, v, cos, sin, has_norm):
        raise ValueError(f"{kernel}: q/k/v must be [T, H, D] with a contiguous last dim and even D "
                         f"(<= {MAX_NORM_HEAD_DIM} with norms), cos/sin [T, D/2] with equal strides; got q "
                         f"{tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} cos {tuple(cos.shape)}")
    num_tokens, _, head_dim = q.shape
    half = head_dim // 2
    if k.shape[0] != num_tokens or q.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"{kernel}: q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} "
                         f"must share tokens and dtype")
    if cos.shape != (num_tokens, half) or sin.shape != cos.shape:
        raise ValueError(f"{kernel}: cos/sin must be [{num_tokens}, {half}], got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    if has_norm and (q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,)):
        raise ValueError(f"{kernel}: norm weights must be [{head_dim}], got {tuple(q_weight.shape)}, "
                         f"{tuple(k_weight.shape)}")
    _check_store_shapes(k, v, k_cache, v_cache, slot_mapping)
    return has_norm


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
    q_out: torch.Tensor | None = None,  # [T, Hq, D] contiguous, q's dtype: where q goes (None: a new tensor)
) -> torch.Tensor:
    """rotary(norm(q)) -> [T, Hq, D] contiguous in q's dtype (`q_out` when given); rotary(norm(k)) and v
    written into the cache. The same bits as rms_norm_pair, apply_rotary on q and on k, then store_kv."""
    has_norm = check_qk_inputs("qk_norm_rope_store", q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_weight,
                               k_weight)
    num_tokens, num_q_heads, head_dim = q.shape
    half = head_dim // 2
    quantize = check_kv_scales("qk_norm_rope_store", k_cache, k_scale, v_scale)
    if k_cache.stride(3) != 1:
        raise ValueError("qk_norm_rope_store: k_cache/v_cache head_dim must be contiguous")
    if q_out is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif q_out.shape != q.shape or q_out.dtype != q.dtype or not q_out.is_contiguous():
        raise ValueError(f"qk_norm_rope_store: q_out must be a contiguous {tuple(q.shape)} {q.dtype} tensor, got "
                         f"{tuple(q_out.shape)} {q_out.dtype}")
    if num_tokens == 0:
        return q_out
    num_kv_heads = k.shape[1]
    rows = rows_per_program(num_tokens, num_q_heads, num_kv_heads, q.is_cuda,
                            triton.next_power_of_2(head_dim) * q.element_size())
    groups = triton.cdiv(num_q_heads, rows) + triton.cdiv(num_kv_heads, rows)
    # the normed k between the two phases (the normed q goes through q_out)
    k_normed = torch.empty(k.shape, dtype=k.dtype, device=k.device) if has_norm else q_out
    _qk_norm_rope_store_kernel[(num_tokens, groups)](
        q, k, v, cos, sin,
        q_weight if has_norm else q, k_weight if has_norm else q,  # unread without HAS_NORM
        q_out, k_normed, k_cache, v_cache, slot_mapping,
        k_scale if quantize else slot_mapping, v_scale if quantize else slot_mapping,  # unread without QUANTIZE
        num_q_heads, num_kv_heads, head_dim, half, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1],
        ROWS=rows, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_HALF=triton.next_power_of_2(half),
        HAS_NORM=has_norm, QUANTIZE=quantize, num_warps=rows, **pdl_launch(q.device),
    )
    return q_out
