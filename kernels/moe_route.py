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
def _moe_route_kernel(logits, weights, ids, num_experts, stride_row, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                      BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    mask = cols < num_experts
    z = tl.load(logits + row * stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
    z = z - tl.max(z, axis=0)
    e = tl.where(mask, tl.exp(z), 0.0)
    p = e / tl.sum(e, axis=0)
    p = tl.where(mask, p, -1.0)
    ks = tl.arange(0, K_PAD)
    top_w = tl.zeros((K_PAD,), dtype=tl.float32)
    top_i = tl.zeros((K_PAD,), dtype=tl.int32)
    for k in tl.static_range(TOP_K):  # the k largest in registers (no store and reload within the program)
        best = tl.max(p, axis=0)
        col = tl.min(tl.where(p == best, cols, BLOCK_E), axis=0)
        top_w = tl.where(ks == k, best, top_w)
        top_i = tl.where(ks == k, col, top_i)
        p = tl.where(cols == col, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    tl.store(weights + row * TOP_K + ks, top_w, mask=ks < TOP_K)
    tl.store(ids + row * TOP_K + ks, top_i, mask=ks < TOP_K)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32)."""
    rows, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts or num_experts > MAX_EXPERTS:
        raise ValueError(f"moe_route: top_k={top_k} must be in [1, {num_experts}] and experts <= {MAX_EXPERTS}")
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(rows, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(rows, top_k, dtype=torch.int32, device=router_logits.device)
    if rows:
        _moe_route_kernel[(rows,)](router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
                                   K_PAD=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(num_experts),
                                   RENORMALIZE=renormalize, num_warps=1 if num_experts <= 256 else 4)
    return weights, ids
