"""Group a step's (token, k) routing slots by expert, each expert's run padded to a multiple of `block_m`, for
the grouped GEMM of `kernels/fused_moe.py`: one block of block_m rows is one expert's.

Torch ops only, no host synchronisation and shapes that depend only on T, k, the expert count and block_m,
so a CUDA graph captures it: the output is sized for the worst case (every expert's run padded), and
`num_padded` [1] (on the device) says how much of it is used.

Slot s = t * k + j is token t's j-th expert. Experts outside [first_expert, first_expert + num_local) (another
rank's, with moe_tp_split=experts) go to one trailing group whose blocks have expert id -1: the GEMM writes
zeros there, so such slots add nothing to the sum over k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MoeAlignment:
    sorted_slots: torch.Tensor  # [max_padded] int32: the slot in each row, `num_slots` in padding rows
    block_experts: torch.Tensor  # [max_padded // block_m] int32: each block's local expert, -1: none
    num_padded: torch.Tensor  # [1] int32: rows in use (a multiple of block_m)
    num_slots: int  # T * k
    block_m: int


def max_padded_rows(num_slots: int, num_groups: int, block_m: int) -> int:
    """Rows for the worst case: a group of c slots takes ceil(c / block_m) <= floor(c / block_m) + 1 blocks,
    and at most min(groups, slots) groups are non-empty (decode at batch 1: k blocks, not one per expert)."""
    return (num_slots // block_m + min(num_groups, num_slots)) * block_m


def moe_align(topk_ids: torch.Tensor, num_local: int, block_m: int, first_expert: int = 0) -> MoeAlignment:
    """topk_ids [T, k] (global expert ids) -> the slots grouped by local expert, runs padded to block_m."""
    device = topk_ids.device
    num_slots = topk_ids.numel()
    groups = num_local + 1  # the last group: experts of other ranks
    local = topk_ids.reshape(-1).long() - first_expert
    group = torch.where((local >= 0) & (local < num_local), local, torch.full_like(local, num_local))
    counts = torch.zeros(groups, dtype=torch.int64, device=device)
    counts.scatter_add_(0, group, torch.ones_like(group))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    run_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(group, stable=True)
    sorted_group = group[order]
    rank_in_run = torch.arange(num_slots, device=device) - run_start[sorted_group]
    max_rows = max_padded_rows(num_slots, groups, block_m)
    sorted_slots = torch.full((max_rows,), num_slots, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, padded_start[sorted_group] + rank_in_run, order.to(torch.int32))
    block_rows = torch.arange(0, max_rows, block_m, device=device)
    block_group = torch.searchsorted(padded_end, block_rows, right=True)
    block_experts = torch.where(block_group < num_local, block_group, torch.full_like(block_group, -1))
    return MoeAlignment(sorted_slots, block_experts.to(torch.int32), padded_end[-1:].to(torch.int32),
                        num_slots, block_m)
