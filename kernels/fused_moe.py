"""Fused MoE experts on the GPU: two Triton grouped GEMMs over the routing slots grouped by expert
(`kernels/moe_align.py`), each block of BLOCK_M rows one expert's, so each touched expert's weights are read
once per block of its tokens and untouched experts not at all.

Steps of at most SMALL_MOE_MAX_TOKENS tokens (decode at small batch) skip the grouping: GEMV-style kernels over
the (token, expert) slots, the down kernel summing each token's k experts itself (3 launches a layer with the
router's, against ~12). Larger steps:
1. gate_up: act[row] = silu(x[t] @ gate_e^T) * (x[t] @ up_e^T) for the slot in each row (t = slot // k), both
   halves of the packed w13 [E, 2I, H] in one program, the activation rounded once to x's dtype.
2. down: y[slot] = weight[slot] * (act[row] @ down_e^T), w2 [E, H, I], float32 accumulation.
Then out[t] = sum over the token's k slots (float32), rounded once to `out_dtype`.

Oracle: `reference.fused_moe_reference` (the CPU path of the MoE layer). Shapes depend on T, k and the expert
count only (no host synchronisation), so CUDA graphs capture it. `block_config` picks the tiles from the
average slots per expert; `warm_up` compiles every configuration the engine can pick before the first step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.attention_support import dot_precision
from spmd_engine.kernels.moe_align import moe_align

BLOCK_MS = (16, 32, 64)


@triton.jit(do_not_specialize=["num_slots"])  # T x k changes every step: one compiled kernel for all
def _gate_up_kernel(x, w13, act, sorted_slots, block_experts, num_padded, num_slots, inter, hidden,
                    stride_xt, stride_we, stride_wn, stride_at, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded):
        return
    expert = tl.load(block_experts + pid_m)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots + rows)
    valid = (slots < num_slots) & (expert >= 0)
    tokens = (slots // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = (cols < inter) & (expert >= 0)
    w_base = w13 + tl.maximum(expert, 0).to(tl.int64) * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden
        a = tl.load(x + tokens[:, None] * stride_xt + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = col_mask[None, :] & k_mask[:, None]
        w_gate = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (cols + inter)[None, :].to(tl.int64) * stride_wn + ks[:, None], mask=w_mask,
                       other=0.0)
        acc_gate = tl.dot(a, w_gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
    out = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(act + rows[:, None].to(tl.int64) * stride_at + cols[None, :], out.to(act.dtype.element_ty),
             mask=(slots < num_slots)[:, None] & (cols < inter)[None, :])


@triton.jit(do_not_specialize=["num_slots"])
def _down_kernel(act, w2, y, sorted_slots, block_experts, topk_weights, num_padded, num_slots, hidden, inter,
                 stride_at, stride_we, stride_wn, stride_yt, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded):
        return
    expert = tl.load(block_experts + pid_m)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots + rows)
    in_use = slots < num_slots
    valid = in_use & (expert >= 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_in = cols < hidden
    col_mask = col_in & (expert >= 0)
    w_base = w2 + tl.maximum(expert, 0).to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < inter
        a = tl.load(act + rows[:, None].to(tl.int64) * stride_at + ks[None, :], mask=valid[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                    mask=col_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    weight = tl.load(topk_weights + slots, mask=valid, other=0.0)
    acc = acc * weight[:, None]  # rows of another rank's experts: zeros
    tl.store(y + slots[:, None].to(tl.int64) * stride_yt + cols[None, :], acc.to(y.dtype.element_ty),
             mask=in_use[:, None] & col_in[None, :])


@triton.jit(do_not_specialize=["num_slots", "first_expert"])
def _gate_up_small_kernel(x, w13, act, topk_ids, num_slots, first_expert, num_local, inter, hidden, stride_xt,
                          stride_we, stride_wn, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Small batches: one program per (slot, feature tile), GEMV-style (no sort, no padded rows)."""
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(topk_ids + slot).to(tl.int32) - first_expert
    local = (expert >= 0) & (expert < num_local)
    token = (slot // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = (cols < inter) & local
    w_base = w13 + tl.where(local, expert, 0).to(tl.int64) * stride_we
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden
        xv = tl.load(x + token * stride_xt + ks, mask=k_mask, other=0.0).to(tl.float32)
        w_mask = col_mask[:, None] & k_mask[None, :]
        w_gate = tl.load(w_base + cols[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (cols + inter)[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=w_mask,
                       other=0.0)
        acc_gate += w_gate.to(tl.float32) * xv[None, :]
        acc_up += w_up.to(tl.float32) * xv[None, :]
    gate = tl.sum(acc_gate, axis=1)
    out = gate / (1.0 + tl.exp(-gate)) * tl.sum(acc_up, axis=1)
    tl.store(act + slot.to(tl.int64) * inter + cols, out.to(act.dtype.element_ty), mask=cols < inter)


@triton.jit(do_not_specialize=["first_expert"])
def _down_small_kernel(act, w2, out, topk_ids, topk_weights, first_expert, num_local, hidden, inter, stride_we,
                       stride_wn, stride_ot, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Small batches: one program per (token, output tile), the token's k experts summed in k order (float32)."""
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_in = cols < hidden
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = token * TOP_K + j
        expert = tl.load(topk_ids + slot).to(tl.int32) - first_expert
        local = (expert >= 0) & (expert < num_local)
        weight = tl.load(topk_weights + slot)
        w_base = w2 + tl.where(local, expert, 0).to(tl.int64) * stride_we
        col_mask = col_in & local
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < inter
            a = tl.load(act + slot * inter + ks, mask=k_mask & local, other=0.0).to(tl.float32)
            w = tl.load(w_base + cols[:, None].to(tl.int64) * stride_wn + ks[None, :],
                        mask=col_mask[:, None] & k_mask[None, :], other=0.0)
            acc += w.to(tl.float32) * a[None, :]
        total += tl.sum(acc, axis=1) * weight
    tl.store(out + token * stride_ot + cols, total.to(out.dtype.element_ty), mask=col_in)


# Steps of at most this many tokens take the GEMV-style kernels (no sort: ~10 fewer launches a layer). A
# CUDA-graph batch size (executor/cuda_graphs.py), so a decode batch and its padded graph take the same path.
SMALL_MOE_MAX_TOKENS = 16
# (BLOCK_N, BLOCK_K) of the gate_up and down GEMVs: 155 / 168 registers a thread on sm_90, no spills (128-deep
# K tiles spilled)
SMALL_BLOCKS = ((32, 64), (16, 64))


def _fused_moe_small(x, w13, w2, topk_weights, topk_ids, first_expert, out_dtype):
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_local, inter2, _ = w13.shape
    inter = inter2 // 2
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.float().contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    (gate_n, gate_k), (down_n, down_k) = SMALL_BLOCKS
    _gate_up_small_kernel[(num_tokens * top_k, triton.cdiv(inter, gate_n))](
        x, w13, act, ids, num_tokens * top_k, first_expert, num_local, inter, hidden, x.stride(0), w13.stride(0),
        w13.stride(1), TOP_K=top_k, BLOCK_N=gate_n, BLOCK_K=gate_k, num_warps=4)
    out = torch.empty(num_tokens, hidden, dtype=out_dtype, device=x.device)
    _down_small_kernel[(num_tokens, triton.cdiv(hidden, down_n))](
        act, w2, out, ids, weights, first_expert, num_local, hidden, inter, w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_N=down_n, BLOCK_K=down_k, num_warps=4)
    return out


def block_config(num_slots: int, num_local: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) from the average slots per local expert. Small decode batches (a few rows per
    expert: the weights are the traffic) take narrow tiles, twice the programs streaming weights."""
    per_expert = num_slots / max(num_local, 1)
    if per_expert <= 4:
        return 16, 32, 64
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    return block_m, 64, 64


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, first_expert: int = 0, out_dtype: torch.dtype | None = None,
              config: tuple[int, int, int] | None = None, small: bool | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E_local, 2I, H]; w2 [E_local, H, I]; topk_weights [T, k] float32; topk_ids [T, k] (global
    expert ids; this rank holds first_expert ..) -> [T, H] in `out_dtype` (None: x's dtype). `config`: tiles
    (BLOCK_M, BLOCK_N, BLOCK_K) instead of `block_config`'s; `small`: force the GEMV-style path on or off
    (None: T <= SMALL_MOE_MAX_TOKENS) (tests, benches)."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_local, inter2, w_hidden = w13.shape
    inter = inter2 // 2
    if w_hidden != hidden or tuple(w2.shape) != (num_local, hidden, inter):
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} "
                         "do not fit [T, H], [E, 2I, H], [E, H, I]")
    out_dtype = out_dtype or x.dtype
    if num_tokens == 0:
        return torch.zeros(0, hidden, dtype=out_dtype, device=x.device)
    x = x.contiguous()
    if small if small is not None else (num_tokens <= SMALL_MOE_MAX_TOKENS and config is None):
        return _fused_moe_small(x, w13, w2, topk_weights, topk_ids, first_expert, out_dtype)
    num_slots = num_tokens * top_k
    block_m, block_n, block_k = config or block_config(num_slots, num_local)
    align = moe_align(topk_ids, num_local, block_m, first_expert)
    rows = align.sorted_slots.shape[0]
    act = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    # 32 x 64 and larger tiles on 4 warps spill registers on sm_90 (the gate and up accumulators): 8 warps
    warps = 8 if block_m * block_n >= 2048 else 4
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=dot_precision(x.dtype),
                num_warps=warps)
    _gate_up_kernel[(rows // block_m, triton.cdiv(inter, block_n))](
        x, w13, act, align.sorted_slots, align.block_experts, align.num_padded, num_slots, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), TOP_K=top_k, **meta)
    y = torch.empty(num_slots, hidden, dtype=torch.float32 if x.dtype == torch.float32 else x.dtype,
                    device=x.device)
    _down_kernel[(rows // block_m, triton.cdiv(hidden, block_n))](
        act, w2, y, align.sorted_slots, align.block_experts, weights, align.num_padded, num_slots, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), y.stride(0), **meta)
    return y.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(out_dtype)


def warm_up(w13: torch.Tensor, w2: torch.Tensor, top_k: int, max_tokens: int) -> int:
    """Run `fused_moe` once with every tile configuration `block_config` picks for 1..max_tokens tokens (over
    these weights, zero inputs), so that no step compiles a kernel; returns how many configurations ran."""
    num_local, _, hidden = w13.shape
    seen = set()
    tokens = 1
    while tokens <= max(max_tokens, 1):
        config = "small" if tokens <= SMALL_MOE_MAX_TOKENS else block_config(tokens * top_k, num_local)
        if config not in seen:
            seen.add(config)
            x = torch.zeros(tokens, hidden, dtype=w13.dtype, device=w13.device)
            ids = (torch.arange(tokens * top_k, device=w13.device) % num_local).view(tokens, top_k).to(torch.int32)
            fused_moe(x, w13, w2, torch.ones(tokens, top_k, device=w13.device), ids)
        tokens *= 2
    return len(seen)
