"""RopeConfig: the rotary-embedding settings of an HF config, in one normalised form.

HF configs spell these several ways: `rope_scaling` (older) or `rope_parameters` (transformers 5),
`rope_type` or `type`, `rope_theta` at the top level or inside the dict. This reads them all once
so the rotary layer never sees the spelling.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
DEFAULT_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class RopeConfig:
    """Everything the inverse-frequency formulas of the supported rope types read."""

    rope_type: str = "default"
    theta: float = DEFAULT_ROPE_THETA
    factor: float = 1.0  # linear, dynamic, yarn, llama3
    original_max_position_embeddings: int | None = None  # yarn, llama3
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn (None: derived from factor / mscale)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> RopeConfig:
        key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"  # HF's precedence
        params: dict[str, Any] = dict(config.get(key) or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"{key}.rope_type must be one of {', '.join(SUPPORTED_ROPE_TYPES)}, got {rope_type!r}")
        partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise ValueError(f"{key}.partial_rotary_factor must be 1.0 (full rotary), got {partial}")
        theta = float(params.get("rope_theta") or config.get("rope_theta") or DEFAULT_ROPE_THETA)
        if rope_type == "default":
            return cls(theta=theta)

        def required(name: str) -> Any:
            if params.get(name) is None:
                raise ValueError(f"{key}.{name} is required for rope_type {rope_type!r}")
            return params[name]

        max_pos = config.get("max_position_embeddings")
        original = config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        original = int(original or max_pos) if rope_type in ("yarn", "llama3") else None
        if rope_type == "yarn":
            factor = params.get("factor")
            if factor is None:  # HF: the ratio of the extended to the pretraining context
                factor = max_pos / original
            return cls(
                rope_type=rope_type, theta=theta, factor=float(factor),
                original_max_position_embeddings=original,
                beta_fast=float(params.get("beta_fast") or 32.0),
                beta_slow=float(params.get("beta_slow") or 1.0),
                attention_factor=params.get("attention_factor"),
                mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
                truncate=bool(params.get("truncate", True)),
            )
        factor = float(required("factor"))
        if rope_type == "llama3":
            return cls(
                rope_type=rope_type, theta=theta, factor=factor, original_max_position_embeddings=original,
                low_freq_factor=float(required("low_freq_factor")),
                high_freq_factor=float(required("high_freq_factor")),
            )
        return cls(rope_type=rope_type, theta=theta, factor=factor)
