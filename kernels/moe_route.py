"""Triton MoE router: softmax over the experts (float32), the k largest, optional renormalisation, in one
launch per step (one program per token row). Oracle: `reference.moe_route_reference`.

Ties go to the lowest expert id, as torch.topk on CPU does for distinct positions of equal value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 1024  # one row of logits in registers


@triton.jit
def _moe_route_kernel(logits, weights, ids, num_experts, stride_row, TOP_K: tl.constexpr,
                      BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    mask = cols < num_experts
    z = tl.load(logits + row * stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
    z = z - tl.max(z, axis=0)
    e = tl.where(mask, tl.exp(z), 0.0)
    p = e / tl.sum(e, axis=0)
    p = tl.where(mask, p, -1.0)
    total = 0.0
    for k in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        col = tl.min(tl.where(p == best, cols, BLOCK_E), axis=0)
        tl.store(weights + row * TOP_K + k, best)
        tl.store(ids + row * TOP_K + k, col.to(tl.int32))
        total += best
        p = tl.where(cols == col, -1.0, p)
    if RENORMALIZE:
        ks = tl.arange(0, TOP_K)
        w = tl.load(weights + row * TOP_K + ks)
        tl.store(weights + row * TOP_K + ks, w / total)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32). top_k must be a power of
    two for the renormalisation's vector load (Qwen3-MoE: 8); other k values renormalise in torch."""
    rows, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts or num_experts > MAX_EXPERTS:
        raise ValueError(f"moe_route: top_k={top_k} must be in [1, {num_experts}] and experts <= {MAX_EXPERTS}")
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(rows, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(rows, top_k, dtype=torch.int32, device=router_logits.device)
    fused_norm = renormalize and top_k & (top_k - 1) == 0
    if rows:
        _moe_route_kernel[(rows,)](router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
                                   BLOCK_E=triton.next_power_of_2(num_experts), RENORMALIZE=fused_norm,
                                   num_warps=1 if num_experts <= 256 else 4)
    if renormalize and not fused_norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
