"""The MoE kernels (router top-k, slot grouping, fused expert GEMMs) against their torch references: tiny
fp32/fp16 shapes under the Triton interpreter on CPU, the real Qwen3-30B-A3B expert shape in bf16 on a GPU.
Routing skews: uniform, every token to one expert, most experts empty, another rank's experts."""
from __future__ import annotations

import pytest
import torch

from spmd_engine.kernels.fused_moe import fused_moe
from spmd_engine.kernels.moe_align import moe_align
from spmd_engine.kernels.moe_route import moe_route
from spmd_engine.kernels.reference import fused_moe_reference, moe_route_reference
from tests.kernels.paged_batch import DEVICE, gpu_case

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # triton interpreter noise


def routing(skew: str, tokens: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Router logits [T, E] whose top-k follows `skew`."""
    logits = torch.randn(tokens, experts, generator=gen)
    if skew == "one-expert":  # every token's first choice is expert 1 (the rest random)
        logits[:, 1] += 100.0
    elif skew == "few-experts":  # experts >= top_k + 1 never chosen: empty
        logits[:, top_k + 1:] -= 100.0
    return logits


@pytest.mark.parametrize("experts,top_k,renormalize", [(6, 2, True), (8, 3, True), (5, 1, False), (64, 8, True)])
def test_route_matches_reference(experts, top_k, renormalize):
    logits = torch.randn(7, experts, generator=torch.Generator().manual_seed(experts)).to(DEVICE)
    weights, ids = moe_route(logits, top_k, renormalize)
    ref_weights, ref_ids = moe_route_reference(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("first_expert,num_local", [(0, 6), (2, 2), (4, 2)])
def test_align_groups_every_local_slot_once_in_padded_runs(first_expert, num_local):
    ids = torch.tensor([[0, 3], [3, 5], [1, 3], [5, 4], [3, 0]], dtype=torch.int32)
    align = moe_align(ids, num_local, 4, first_expert)
    rows, used = align.sorted_slots.tolist(), int(align.num_padded[0])
    assert used % 4 == 0 and used <= len(rows)
    flat = ids.reshape(-1).tolist()
    seen = []
    for block, expert in enumerate(align.block_experts.tolist()[: used // 4]):
        slots = [s for s in rows[block * 4:(block + 1) * 4] if s < ids.numel()]
        seen += slots
        local = [flat[s] - first_expert for s in slots]
        if expert >= 0:
            assert all(e == expert for e in local)
        else:
            assert all(not 0 <= e < num_local for e in local)
    assert sorted(seen) == list(range(ids.numel()))


SKEWS = ["uniform", "one-expert", "few-experts"]
CASES = [  # tokens, hidden, inter, experts, top_k, dtype, skew
    *[(3, 32, 24, 4, 2, torch.float32, skew) for skew in SKEWS],
    *[(20, 48, 40, 6, 3, torch.float16, skew) for skew in SKEWS],
    (1, 32, 16, 8, 2, torch.float16, "uniform"),
    (40, 32, 16, 4, 2, torch.float32, "one-expert"),  # 20 slots per expert: 32-row blocks
    (70, 32, 16, 4, 4, torch.float16, "uniform"),  # 70 slots per expert: 64-row blocks
]


@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k,dtype,skew", CASES)
def test_fused_moe_matches_reference(tokens, hidden, inter, experts, top_k, dtype, skew):
    gen = torch.Generator().manual_seed(tokens * 7 + experts)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype).to(DEVICE)
    weights, ids = moe_route_reference(routing(skew, tokens, experts, top_k, gen), top_k, True)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ref = fused_moe_reference(x, w13, w2, weights, ids).float()
    paths = (True, False) if tokens <= 3 else (False,)  # GEMV-style kernels (one interpreted program a slot), grouped
    for small in paths:
        out = fused_moe(x, w13, w2, weights, ids, small=small)
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    # a rank holding only experts [2, 4) (moe_tp_split=experts): the others add nothing; float32 out for the sum
    part_ref = fused_moe_reference(x, w13[2:4], w2[2:4], weights, ids, first_expert=2, out_dtype=torch.float32)
    for small in paths:
        part = fused_moe(x, w13[2:4], w2[2:4], weights, ids, first_expert=2, out_dtype=torch.float32, small=small)
        assert part.dtype == torch.float32
        torch.testing.assert_close(part, part_ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("tokens", [gpu_case(n) for n in (1, 7, 64, 512, 4096)])
@pytest.mark.parametrize("skew", SKEWS)
def test_fused_moe_qwen3_30b_shape_bf16(tokens, skew):
    """One layer of Qwen3-30B-A3B (128 experts of 2048 x 768, 8 per token) in bf16."""
    gen = torch.Generator().manual_seed(tokens)
    hidden, inter, experts, top_k = 2048, 768, 128, 8
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEVICE, torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, torch.bfloat16)
    weights, ids = moe_route(routing(skew, tokens, experts, top_k, gen).to(DEVICE), top_k, True)
    out = fused_moe(x, w13, w2, weights, ids).float()
    ref = fused_moe_reference(x, w13, w2, weights, ids).float()
    assert (out - ref).norm() / ref.norm() < 1e-2
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


def test_warm_up_runs_each_tile_configuration_once():
    from spmd_engine.kernels.fused_moe import warm_up

    w13, w2 = torch.zeros(4, 32, 16, device=DEVICE), torch.zeros(4, 16, 16, device=DEVICE)
    assert warm_up(w13, w2, top_k=2, max_tokens=64) == 3  # the small path to 16 tokens, 16-row blocks, 32-row at 64


def test_align_buffers_hold_the_worst_case():
    gen = torch.Generator().manual_seed(1)
    for tokens, experts, top_k, block_m in ((1, 128, 8, 16), (3, 4, 2, 16), (50, 8, 2, 4), (7, 64, 8, 64)):
        for trial in range(20):
            ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
            if trial % 2:  # skewed: the same few experts, some rows of another rank's
                ids = ids % 3
            for first, local in ((0, experts), (experts // 2, experts // 2)):
                align = moe_align(ids.to(torch.int32), local, block_m, first)
                assert int(align.num_padded[0]) <= align.sorted_slots.numel()
                assert align.block_experts.numel() * block_m == align.sorted_slots.numel()
