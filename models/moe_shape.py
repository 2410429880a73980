"""MoeShape: the sparse-MoE numbers of an HF config (Qwen3-MoE style) and how the experts split over ranks.

Two tensor-parallel splits (`moe_tp_split`):
- `experts`: each rank holds num_experts / tp whole experts and runs them on every token routed to them;
  tokens routed elsewhere contribute zero on this rank, and the row-parallel all-reduce sums the ranks.
- `intermediate`: each rank holds every expert with 1/tp of its intermediate features (as a dense MLP).
Activations are replicated inside the group either way, so neither needs an all-to-all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_TP_SPLIT_EXPERTS = "experts"
MOE_TP_SPLIT_INTERMEDIATE = "intermediate"
MOE_TP_SPLITS = (MOE_TP_SPLIT_EXPERTS, MOE_TP_SPLIT_INTERMEDIATE)
DEFAULT_MOE_TP_SPLIT = MOE_TP_SPLIT_EXPERTS
# the hf_config key the engine sets from its `moe_tp_split` key (HF configs never carry it)
MOE_TP_SPLIT_KEY = "moe_tp_split"


@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    top_k: int  # experts per token (num_experts_per_tok)
    intermediate_size: int  # per expert (moe_intermediate_size)
    norm_topk_prob: bool = False  # renormalise the k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (those keep a dense MLP)
    tp_split: str = DEFAULT_MOE_TP_SPLIT

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> MoeShape | None:
        """None for a dense config (no experts)."""
        experts = config.get("num_experts", config.get("num_local_experts"))
        if not experts:
            return None
        if "num_experts_per_tok" not in config or "moe_intermediate_size" not in config:
            raise ValueError("model config with num_experts needs num_experts_per_tok and moe_intermediate_size")
        split = config.get(MOE_TP_SPLIT_KEY) or DEFAULT_MOE_TP_SPLIT
        if split not in MOE_TP_SPLITS:
            raise ValueError(f"moe_tp_split must be one of {'|'.join(MOE_TP_SPLITS)}, got {split!r}")
        shape = cls(
            num_experts=int(experts),
            top_k=int(config["num_experts_per_tok"]),
            intermediate_size=int(config["moe_intermediate_size"]),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            decoder_sparse_step=int(config.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in (config.get("mlp_only_layers") or ())),
            tp_split=split,
        )
        if not 1 <= shape.top_k <= shape.num_experts:
            raise ValueError(f"model num_experts_per_tok must be in [1, num_experts={shape.num_experts}], "
                             f"got {shape.top_k}")
        return shape

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the MoE block (HF's rule) rather than a dense MLP."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def validate_tensor_parallel(self, tp_size: int) -> None:
        if self.tp_split == MOE_TP_SPLIT_EXPERTS and self.num_experts % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's num_experts="
                             f"{self.num_experts} with moe_tp_split=experts (or use moe_tp_split=intermediate)")
        if self.tp_split == MOE_TP_SPLIT_INTERMEDIATE and self.intermediate_size % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's moe_intermediate_size="
                             f"{self.intermediate_size} with moe_tp_split=intermediate (or use moe_tp_split=experts)")

    def experts_per_rank(self, tp_size: int) -> int:
        return self.num_experts // tp_size if self.tp_split == MOE_TP_SPLIT_EXPERTS else self.num_experts

    def intermediate_per_rank(self, tp_size: int) -> int:
        return self.intermediate_size // tp_size if self.tp_split == MOE_TP_SPLIT_INTERMEDIATE \
            else self.intermediate_size

    def first_expert(self, rank: int, tp_size: int) -> int:
        """The global id of this rank's first expert (its experts are consecutive)."""
        return rank * self.experts_per_rank(tp_size) if self.tp_split == MOE_TP_SPLIT_EXPERTS else 0

    def expert_bytes(self, hidden_size: int, element_size: int) -> int:
        """One whole expert's weights (gate, up, down) in bytes."""
        return 3 * hidden_size * self.intermediate_size * element_size
