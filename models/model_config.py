"""ModelShape: the few numbers of an HF config that size the model, its shards and its KV cache.

Built once from the HF `config.json` dict, so the engine, the KV-cache sizing and the model
classes all read the same normalised values (HF spells several of them more than one way).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spmd_engine.models.layers.rope_config import RopeConfig
from spmd_engine.models.moe_shape import MoeShape

_ARCHITECTURE_BY_MODEL_TYPE = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                               "mistral": "MistralForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                               "qwen3_moe": "Qwen3MoeForCausalLM"}
SLIDING, FULL = "sliding_attention", "full_attention"  # HF's `layer_types` entries


def _layer_windows(config: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as HF reads the config: `layer_types` when given;
    else Qwen2's `use_sliding_window` (layers from `max_window_layers` on), Gemma 3's older
    `sliding_window_pattern` (every pattern-th layer full), or Mistral's one `sliding_window` for all."""
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if "use_sliding_window" in config and not config["use_sliding_window"]:
        window = None  # Qwen2/Qwen3: the window is ignored unless switched on
    if types is None:
        if not window:
            return (0,) * num_layers
        if "use_sliding_window" in config:
            first = int(config.get("max_window_layers") or 0)
            types = [SLIDING if i >= first else FULL for i in range(num_layers)]
        elif config.get("sliding_window_pattern"):
            pattern = int(config["sliding_window_pattern"])
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
        else:
            types = [SLIDING] * num_layers
    if len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise ValueError(f"model layer_types must list {num_layers} entries of {SLIDING!r} / {FULL!r}, got {types}")
    if SLIDING in types and not (isinstance(window, int) and window > 0):
        raise ValueError(f"model sliding_window must be a positive int for {SLIDING!r} layers, got {window!r}")
    return tuple(int(window) if kind == SLIDING else 0 for kind in types)


def _ropes(config: dict[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """(the rope of full-attention layers, that of sliding layers where it differs, else None). Gemma 3 gives
    them per layer type: transformers 5 nests `rope_parameters` by type; older configs give
    `rope_local_base_freq` for the sliding layers beside `rope_theta` / `rope_scaling`."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:
        ropes = [RopeConfig.from_hf_config({**config, "rope_scaling": None, "rope_parameters": params.get(kind)})
                 for kind in (FULL, SLIDING)]
        return ropes[0], ropes[1]
    if config.get("rope_local_base_freq") is not None:
        return RopeConfig.from_hf_config(config), RopeConfig(theta=float(config["rope_local_base_freq"]))
    return RopeConfig.from_hf_config(config), None


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
    qkv_bias: bool = False  # q/k/v biases without an o_proj bias (Qwen2)
    layer_windows: tuple[int, ...] = ()  # per layer: a sliding window of that many positions, 0 = full
    local_rope: RopeConfig | None = None  # the sliding layers' rope where it differs (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma); None: head_dim
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)
    attn_logit_softcapping: float | None = None
    moe: MoeShape | None = None  # sparse-MoE layers (models/moe_shape.py); None: dense

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelShape:
        architectures = config.get("architectures") or []
        architecture = architectures[0] if architectures else _ARCHITECTURE_BY_MODEL_TYPE.get(config.get("model_type"))
        if architecture is None:
            raise ValueError("model config needs `architectures` (or a known `model_type`), got neither")
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        dtype = config.get("torch_dtype") or config.get("dtype")
        num_layers = int(config["num_hidden_layers"])
        rope, local_rope = _ropes(config)
        scalar = config.get("query_pre_attn_scalar")
        return cls(
            architecture=architecture,
            num_layers=num_layers,
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=rope,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            eos_token_ids=_eos_ids(config.get("eos_token_id")),
            torch_dtype=str(dtype).removeprefix("torch.") if dtype else None,
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            hidden_act=str(config.get("hidden_act") or config.get("hidden_activation") or "silu"),
            qkv_bias=architecture == "Qwen2ForCausalLM",
            layer_windows=_layer_windows(config, num_layers),
            local_rope=local_rope,
            query_pre_attn_scalar=float(scalar) if scalar is not None else None,
            final_logit_softcapping=config.get("final_logit_softcapping"),
            attn_logit_softcapping=config.get("attn_logit_softcapping"),
            moe=MoeShape.from_hf_config(config),
        )

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

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
