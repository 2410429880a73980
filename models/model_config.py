"""ModelShape: the few numbers of an HF config that size the model, its shards and its KV cache.

Built once from the HF `config.json` dict, so the engine, the KV-cache sizing and the model
classes all read the same normalised values (HF spells several of them more than one way).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spmd_engine.models.layers.rope_config import RopeConfig
from spmd_engine.models.moe_shape import MoeShape

_ARCHITECTURE_BY_MODEL_TYPE = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                               "qwen3_moe": "Qwen3MoeForCausalLM"}


def _eos_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


@dataclass(frozen=True)
class ModelShape:
    """Sizes of the whole (unsharded) model; `*_per_rank` helpers give one rank's share."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    moe: MoeShape | None = None  # sparse-MoE layers (models/moe_shape.py); None: dense

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelShape:
        architectures = config.get("architectures") or []
        architecture = architectures[0] if architectures else _ARCHITECTURE_BY_MODEL_TYPE.get(config.get("model_type"))
        if architecture is None:
            raise ValueError("model config needs `architectures` (or a known `model_type`), got neither")
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        dtype = config.get("torch_dtype") or config.get("dtype")
        return cls(
            architecture=architecture,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf_config(config),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            eos_token_ids=_eos_ids(config.get("eos_token_id")),
            torch_dtype=str(dtype).removeprefix("torch.") if dtype else None,
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            hidden_act=str(config.get("hidden_act", "silu")),
            moe=MoeShape.from_hf_config(config),
        )

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    def validate_tensor_parallel(self, tp_size: int) -> None:
        """Raise ValueError (one line) when the model cannot be split over `tp_size` ranks."""
        if tp_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
        if self.num_heads % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's "
                             f"num_attention_heads={self.num_heads}")
        if tp_size <= self.num_kv_heads and self.num_kv_heads % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's "
                             f"num_key_value_heads={self.num_kv_heads}")
        if tp_size > self.num_kv_heads and tp_size % self.num_kv_heads:
            raise ValueError(f"tensor_parallel_size={tp_size} must be a multiple of the model's "
                             f"num_key_value_heads={self.num_kv_heads} to replicate KV heads")
        if self.intermediate_size % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's "
                             f"intermediate_size={self.intermediate_size}")
        if self.moe is not None:
            self.moe.validate_tensor_parallel(tp_size)

    def kv_heads_per_rank(self, tp_size: int) -> int:
        """KV heads each rank stores (1 when KV heads are replicated across ranks)."""
        return max(1, self.num_kv_heads // tp_size)
