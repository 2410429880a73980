"""build_model: the HF `architectures` name -> our model class, validated for the TP size.

Call it under `torch.device(...)` with the default dtype set: parameters are allocated there.
"""
from __future__ import annotations

from typing import Any

from spmd_engine.models.causal_lm import CausalLM
from spmd_engine.models.llama import LlamaForCausalLM
from spmd_engine.models.model_config import ModelShape
from spmd_engine.models.parallel import TensorParallel
from spmd_engine.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def build_model(hf_config: dict[str, Any], tp: TensorParallel, attention_backend: str = "torch",
                quantization: str = "auto") -> CausalLM:
    """`quantization` (auto | fp8 | none, models/layers/fp8_linear.py): fp8 linear layers before any weight loads."""
    from spmd_engine.models.layers.fp8_linear import quantize_linear_layers, resolve_quantization

    scheme = resolve_quantization(quantization, hf_config)
    shape = ModelShape.from_hf_config(hf_config)
    model_cls = MODEL_CLASSES.get(shape.architecture)
    if model_cls is None:
        raise ValueError(f"model architecture {shape.architecture!r} is not supported; "
                         f"supported: {', '.join(sorted(MODEL_CLASSES))}")
    if shape.hidden_act != "silu":
        raise ValueError(f"model hidden_act must be 'silu', got {shape.hidden_act!r}")
    if hf_config.get("use_sliding_window"):
        raise ValueError("model use_sliding_window must be false: sliding-window attention is not supported")
    shape.validate_tensor_parallel(tp.world_size)
    model = model_cls(shape, tp, attention_backend)
    model.fp8_scheme = scheme
    if scheme is not None:
        quantize_linear_layers(model, scheme)
    return model
