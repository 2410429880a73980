"""Start-up checks of files that each node sees on its own: the weights and the prompts file.

Why: on a cluster the checkpoint or the prompts file may be missing on one node only; checked
inside `agreed`, every rank stops with one line before any weight is read, instead of one rank
crashing half-way through loading while the others wait.
"""
from __future__ import annotations

import os
from pathlib import Path

from spmd_engine.config import ConfigError


def check_checkpoint_files(checkpoint_dir: str | os.PathLike | None) -> None:
    """Every .safetensors file the checkpoint names exists and is readable on this node."""
    if checkpoint_dir is None:
        return
    from spmd_engine.models.loader import safetensors_files

    try:
        files = safetensors_files(checkpoint_dir)
    except (ValueError, OSError, KeyError) as exc:
        raise ConfigError(str(exc)) from None
    missing = [f for f in files if not (f.is_file() and os.access(f, os.R_OK))]
    if missing:
        raise ConfigError(f"model.path={str(checkpoint_dir)!r}: {len(missing)} of {len(files)} weight files are "
                          f"missing or unreadable on this node, e.g. {missing[0].name}")


def check_prompts_file(prompts_file: str | None) -> None:
    """The prompts file (read by rank 0 only, after the weights load) exists and is readable now."""
    if prompts_file is None:
        return
    path = Path(prompts_file).expanduser()
    if not path.is_file():
        raise ConfigError(f"prompts_file={prompts_file!r}: no such file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"prompts_file={prompts_file!r}: not readable")
