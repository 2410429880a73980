"""Sampling defaults from the checkpoint's generation_config.json (vLLM's `generation_config=auto`).

Why: model authors ship the sampling their model was tuned for (Qwen3: temperature 0.6, top_p
0.95, top_k 20); a job or an `LLM(...)` that does not say otherwise should use it (vLLM applies them
by default too). Precedence, lowest first: the config file's `sampling.*` defaults < the checkpoint's
generation_config.json < `sampling.*` keys given on the command line or as `LLM(sampling={...})` < a
prompts-file line's own keys or a request's own SamplingParams.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("spmd_engine")

# generation_config.json keys that become sampling defaults (those this engine's sampler supports)
SUPPORTED_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")
# keys other engines take from there that this one does not (reported, never silently applied)
UNSUPPORTED_KEYS: tuple[str, ...] = ()


def read_generation_config(model_dir: str | Path | None) -> dict[str, Any]:
    """The sampling-related values of `model_dir/generation_config.json` ({} when there is none)."""
    if model_dir is None:
        return {}
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        log.warning("%s could not be read; sampling defaults come from the config only", path)
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: data[k] for k in (*SUPPORTED_KEYS, *UNSUPPORTED_KEYS) if k in data and data[k] is not None}


def apply_generation_config(sampling, model_dir: str | Path | None, explicit: set[str], keeper: str = "command line"):
    """`sampling` (a SamplingParams) with the checkpoint's values for the keys `keeper` (the command line,
    or `LLM(sampling=...)`) left alone, and one log line saying what was taken (or what could not be);
    validated like any default."""
    from spmd_engine.config import ConfigError
    from spmd_engine.core.sequence import SamplingParams

    found = read_generation_config(model_dir)
    taken = {k: v for k, v in found.items() if k in SUPPORTED_KEYS and k not in explicit}
    if taken.get("top_k") == 0:
        taken["top_k"] = -1  # HF's "off"
    skipped = [k for k in found if k in UNSUPPORTED_KEYS and found[k] not in (1, 1.0, 0, 0.0)]
    if not taken and not skipped:
        return sampling
    try:
        checked = SamplingParams.from_dict(taken, SamplingParams(**vars(sampling)))
    except ValueError as exc:
        raise ConfigError(f"{Path(model_dir) / 'generation_config.json'}: {exc}") from None
    overridden = sorted(k for k in found if k in SUPPORTED_KEYS and k in explicit)
    log.info("sampling defaults from %s: %s%s%s", Path(model_dir) / "generation_config.json",
             ", ".join(f"{k}={v}" for k, v in taken.items()) or "none",
             f" ({keeper} keeps {', '.join(overridden)})" if overridden else "",
             f"; not applied (unsupported): {', '.join(f'{k}={found[k]}' for k in skipped)}" if skipped else "")
    return dataclasses.replace(sampling, **{k: getattr(checked, k) for k in taken})


def checkpoint_sampling(cfg, explicit: set[str], keeper: str = "command line"):
    """The sampling defaults (`cfg.sampling`, a SamplingParams) under the checkpoint's
    generation_config.json, the `explicit` keys kept: set on `cfg` before the engine is built, so the
    engine is made with the sampling its requests take."""
    from spmd_engine.executor.model_source import resolve_model_source

    checkpoint_dir = resolve_model_source(cfg.model).checkpoint_dir
    return apply_generation_config(cfg.sampling, checkpoint_dir, explicit, keeper)
