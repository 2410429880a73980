"""Where a checkpoint lives on disk, and what is in it (config, tokenizer).

Why: engine ranks may have no network, so `model.path` is resolved strictly offline (a local
directory, or a hub id already in the local HF cache) and every failure names where we looked.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

# a hub repo id as `hf download` takes it: "org/name" (no leading ./, ../, / or ~; one slash)
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def hf_hub_cache() -> Path:
    """The local HF hub cache, from the environment at call time (HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def _cached_snapshot(repo_id: str, cache: Path) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True))
    except (ValueError, OSError):  # invalid repo id (HFValidationError) / not cached (LocalEntryNotFoundError)
        return None


def looks_like_hub_id(text: str) -> bool:
    """`org/name` and nothing a user would type as a path (absolute, ./, ../, ~, several levels)."""
    return HUB_ID.fullmatch(text) is not None and text.split("/")[0] not in (".", "..")


def resolve_checkpoint(path_or_hub_id: str) -> Path:
    """A directory with config.json: `path_or_hub_id` itself, or its snapshot in the local HF cache."""
    local = Path(path_or_hub_id).expanduser()
    if local.is_dir():
        if (local / "config.json").is_file():
            return local.absolute()
        raise FileNotFoundError(f"model.path={path_or_hub_id!r}: the directory has no config.json")
    cache = hf_hub_cache()
    snapshot = _cached_snapshot(path_or_hub_id, cache)
    if snapshot is not None and (snapshot / "config.json").is_file():
        return snapshot
    if not looks_like_hub_id(path_or_hub_id):  # a filesystem path: offering a download of it misleads
        raise FileNotFoundError(f"model.path={path_or_hub_id!r}: no such directory (give a checkpoint directory "
                                f"with config.json, or a hub id like Qwen/Qwen3-0.6B from the local HF cache)")
    raise FileNotFoundError(
        f"model.path={path_or_hub_id!r}: no directory with config.json there and not in the local HF cache "
        f"({cache}); download it with `hf download {path_or_hub_id}` on a machine with hub access "
        f"(config.json alone is enough with model.load_format=dummy)"
    )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def read_hf_config(model_dir: str | os.PathLike) -> dict:
    """config.json, with generation_config.json's eos_token_id (often a list) taking precedence."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json")
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        eos = _read_json(generation).get("eos_token_id")
        if eos is not None:
            config["eos_token_id"] = eos
    return config


def has_tokenizer(model_dir: str | os.PathLike) -> bool:
    """True when the directory holds tokenizer files AutoTokenizer can load."""
    return any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES)

