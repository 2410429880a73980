"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): dense Qwen3 attention, and in the sparse layers a router
(softmax top-k, optionally renormalised) over `num_experts` SwiGLU experts instead of the dense MLP.

The decoder is Llama's / Qwen3's (`LlamaForCausalLM.make_mlp` puts the MoE block in a layer). Experts are
stacked per rank: w13 [E_local, 2I_local, H] (gate rows | up rows) and w2 [E_local, H, I_local], loaded from
HF's per-expert tensors `mlp.experts.{e}.{gate,up,down}_proj.weight`; the tensor-parallel split
(`moe_tp_split`, models/moe_shape.py) is whole experts per rank or every expert's intermediate features.
The partial outputs of the ranks are summed by the same all-reduce as a row-parallel layer's.
"""
from __future__ import annotations

import torch
from torch import nn

from spmd_engine.models.causal_lm import ShardId
from spmd_engine.models.layers.linear import SmallBatchSwitch, linear, triton_available
from spmd_engine.models.layers.weight_loading import copy_checked, new_parameter
from spmd_engine.models.model_config import ModelShape
from spmd_engine.models.moe_shape import MOE_TP_SPLIT_INTERMEDIATE, MoeShape
from spmd_engine.models.parallel import TensorParallel
from spmd_engine.models.qwen3 import Qwen3ForCausalLM

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_WARMED: set[tuple] = set()  # fused MoE kernel configurations compiled in this process (warm_up_kernels)


class MoeRouter(SmallBatchSwitch, nn.Module):
    """The router's [num_experts, hidden] weight, replicated on every rank (HF's `mlp.gate`)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = new_parameter(num_experts, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, small_batch_gemv=self.small_batch_gemv)


class MoeExperts(nn.Module):
    """This rank's experts, stacked; `weight_loader(param, full, (expert, projection))` takes one HF
    per-expert tensor and keeps this rank's part (nothing for another rank's expert)."""

    def __init__(self, moe: MoeShape, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.num_local = moe.experts_per_rank(tp.world_size)
        self.first_expert = moe.first_expert(tp.rank, tp.world_size)
        self.inter = moe.intermediate_per_rank(tp.world_size)
        # this rank's first intermediate feature of every expert (moe_tp_split=intermediate), else 0
        self.intermediate_start = tp.rank * self.inter if moe.tp_split == MOE_TP_SPLIT_INTERMEDIATE else 0
        self.w13 = new_parameter(self.num_local, 2 * self.inter, hidden_size, loader=self.load_expert)
        self.w2 = new_parameter(self.num_local, hidden_size, self.inter, loader=self.load_expert)

    def load_expert(self, param: nn.Parameter, full: torch.Tensor, shard_id: tuple[int, str]) -> None:
        expert, projection = shard_id
        local = expert - self.first_expert
        if not 0 <= local < self.num_local:
            return  # another rank's expert
        start = self.intermediate_start
        if projection == "down_proj":
            copy_checked(param.data[local], full.narrow(1, start, self.inter), f"expert {expert} down_proj")
        else:
            offset = 0 if projection == "gate_proj" else self.inter
            copy_checked(param.data[local].narrow(0, offset, self.inter), full.narrow(0, start, self.inter),
                         f"expert {expert} {projection}")


class Qwen3MoeSparseBlock(nn.Module):
    """router -> top-k experts per token -> their weighted sum; summed over the ranks like a row-parallel layer."""

    def __init__(self, shape: ModelShape, tp: TensorParallel) -> None:
        super().__init__()
        moe = shape.moe
        assert moe is not None
        self.tp, self.top_k, self.renormalize = tp, moe.top_k, moe.norm_topk_prob
        self.gate = MoeRouter(shape.hidden_size, moe.num_experts)
        self.experts = MoeExperts(moe, shape.hidden_size, tp)

    def touched_bytes(self, num_tokens: int) -> float:
        """Expected bytes of this rank's experts that one step of `num_tokens` tokens reads, under uniform
        routing (k experts per token of E): num_local x (1 - (1 - k/E)^T) experts (the bench floor)."""
        experts, total = self.experts, self.gate.weight.shape[0]
        per_expert = (experts.w13[0].numel() + experts.w2[0].numel()) * experts.w13.element_size()
        return experts.num_local * (1.0 - (1.0 - self.top_k / total) ** num_tokens) * per_expert

    def active_params_per_token(self) -> float:
        """This rank's share of one token's k experts' parameters, in expectation (prefill FLOPs)."""
        experts, total = self.experts, self.gate.weight.shape[0]
        return self.top_k * experts.num_local / total * (experts.w13[0].numel() + experts.w2[0].numel())

    def warm_up_kernels(self, max_tokens: int) -> None:
        """Compile the fused MoE kernels for every tile configuration a step of up to `max_tokens` tokens may
        pick (CUDA; once per weight shape and dtype), so that none compiles mid-job."""
        w13, w2 = self.experts.w13, self.experts.w2
        key = (tuple(w13.shape), w13.dtype, str(w13.device), self.top_k, max_tokens)
        if not (w13.is_cuda and triton_available()) or key in _WARMED:
            return
        from spmd_engine.kernels.fused_moe import warm_up

        warm_up(w13, w2, self.top_k, max_tokens)
        _WARMED.add(key)

    def use_kernels(self, x: torch.Tensor) -> bool:
        """The Triton kernels (CUDA), else the torch reference (CPU)."""
        return x.is_cuda and triton_available()

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (routing weights [T, k] float32, expert ids [T, k] int32)."""
        logits = self.gate(hidden)
        if self.use_kernels(logits):
            from spmd_engine.kernels.moe_route import moe_route

            return moe_route(logits, self.top_k, self.renormalize)
        from spmd_engine.kernels.reference import moe_route_reference

        return moe_route_reference(logits, self.top_k, self.renormalize)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(hidden)
        experts = self.experts
        # several ranks with float32 sums: the partial outputs stay float32 through the all-reduce (RowParallelLinear)
        fp32_sum = self.tp.world_size > 1 and self.tp.reduce_dtype is not None and hidden.dtype != torch.float32
        out_dtype = torch.float32 if fp32_sum else hidden.dtype
        if self.use_kernels(hidden):
            from spmd_engine.kernels.fused_moe import fused_moe

            out = fused_moe(hidden, experts.w13, experts.w2, weights, ids, experts.first_expert, out_dtype)
        else:
            from spmd_engine.kernels.reference import fused_moe_reference

            out = fused_moe_reference(hidden, experts.w13, experts.w2, weights, ids, experts.first_expert, out_dtype)
        return self.tp.all_reduce(out).to(hidden.dtype)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, layer: int) -> nn.Module | None:
        moe = self.shape.moe
        if moe is None:
            raise ValueError("Qwen3MoeForCausalLM needs num_experts in the model config")
        return Qwen3MoeSparseBlock(self.shape, self.tp) if moe.is_sparse(layer) else None

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().checkpoint_shapes()
        s, moe = self.shape, self.shape.moe
        assert moe is not None
        h, inter = s.hidden_size, moe.intermediate_size
        for i in range(s.num_layers):
            if not moe.is_sparse(i):
                continue
            prefix = f"model.layers.{i}.mlp."
            for name in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
                del shapes[prefix + name]
            shapes[prefix + "gate.weight"] = (moe.num_experts, h)
            for e in range(moe.num_experts):
                shapes.update({f"{prefix}experts.{e}.gate_proj.weight": (inter, h),
                               f"{prefix}experts.{e}.up_proj.weight": (inter, h),
                               f"{prefix}experts.{e}.down_proj.weight": (h, inter)})
        return shapes

    def checkpoint_to_parameter(self, name: str) -> tuple[str, ShardId]:
        parts = name.split(".")  # model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight
        if len(parts) == 8 and parts[3:5] == ["mlp", "experts"] and parts[6] in EXPERT_PROJECTIONS \
                and parts[7] == "weight":
            stacked = "w2" if parts[6] == "down_proj" else "w13"
            return ".".join(parts[:5] + [stacked]), (int(parts[5]), parts[6])  # type: ignore[return-value]
        return super().checkpoint_to_parameter(name)
