"""build_model: the HF `architectures` name -> our model class, validated for the TP size.

Call it under `torch.device(...)` with the default dtype set: parameters are allocated there.
"""
from __future__ import annotations

from typing import Any

from spmd_engine.models.causal_lm import CausalLM
from spmd_engine.models.gemma3 import Gemma3ForCausalLM
from spmd_engine.models.llama import LlamaForCausalLM
from spmd_engine.models.model_config import ModelShape
from spmd_engine.models.moe_shape import MOE_TP_SPLIT_KEY
from spmd_engine.models.parallel import TensorParallel
from spmd_engine.models.qwen3 import Qwen3ForCausalLM
from spmd_engine.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # q/k/v biases (ModelShape.qkv_bias), no q/k norm
    "MistralForCausalLM": LlamaForCausalLM,  # a sliding window on every layer where `sliding_window` is set
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def build_model(hf_config: dict[str, Any], tp: TensorParallel, attention_backend: str = "torch",
                moe_tp_split: str | None = None, quantization: str = "auto") -> CausalLM:
    """`moe_tp_split`: experts | intermediate for an MoE model (models/moe_shape.py); None: the config's or
    the default. `quantization` (auto | fp8 | none, models/layers/fp8_linear.py): fp8 linear layers before any
    weight loads."""
    from spmd_engine.models.layers.fp8_linear import quantize_linear_layers, resolve_quantization

    if moe_tp_split is not None:
        hf_config = {**hf_config, MOE_TP_SPLIT_KEY: moe_tp_split}
    scheme = resolve_quantization(quantization, hf_config)
    shape = ModelShape.from_hf_config(hf_config)
    model_cls = MODEL_CLASSES.get(shape.architecture)
    if model_cls is None:
        raise ValueError(f"model architecture {shape.architecture!r} is not supported; "
                         f"supported: {', '.join(sorted(MODEL_CLASSES))}")
    activations = getattr(model_cls, "hidden_acts", ("silu",))
    if shape.hidden_act not in activations:
        raise ValueError(f"model hidden_act must be {' or '.join(map(repr, activations))}, got {shape.hidden_act!r}")
    if shape.attn_logit_softcapping:
        raise ValueError(f"model attn_logit_softcapping must be null (not supported), got "
                         f"{shape.attn_logit_softcapping}")
    shape.validate_tensor_parallel(tp.world_size)
    model = model_cls(shape, tp, attention_backend)
    model.fp8_scheme = scheme
    if scheme is not None:
        quantize_linear_layers(model, scheme)
    return model
