"""The job's sampling defaults: the checkpoint's generation_config.json (spmd_engine/generation_defaults.py)
under the `sampling.*` keys the command line sets.

Why here: reading Hydra override strings is the job's business; the API names its explicit keys itself.
"""
from __future__ import annotations

from spmd_engine.generation_defaults import checkpoint_sampling


def explicit_sampling_keys(overrides: list[str]) -> set[str]:
    """The `sampling.*` keys the command line sets (Hydra override strings such as `sampling.top_k=5`,
    `+sampling.seed=1`, `~sampling.x`)."""
    keys = set()
    for item in overrides:
        name = item.split("=", 1)[0].lstrip("+~")
        if name.startswith("sampling."):
            keys.add(name[len("sampling."):])
    return keys


def job_sampling(cfg, overrides: list[str]):
    """The job's sampling defaults (`cfg.sampling`, a SamplingParams) under the checkpoint's
    generation_config.json, the command line's `sampling.*` keys kept: set on `cfg` before the engine is
    built, so the engine is made with the sampling its requests take."""
    return checkpoint_sampling(cfg, explicit_sampling_keys(overrides))
