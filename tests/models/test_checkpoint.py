import json
from pathlib import Path

import pytest

from spmd_engine.models.checkpoint import (has_tokenizer, hf_hub_cache, looks_like_hub_id, read_hf_config,
                                           resolve_checkpoint)


def _fake_hub_snapshot(hub: Path, repo_id: str, commit: str = "0123abcd") -> Path:
    """The on-disk layout huggingface_hub leaves after a download of `repo_id`."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return snapshot


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_local_directory(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    assert resolve_checkpoint(str(tmp_path / "ckpt")) == tmp_path / "ckpt"
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint("ckpt") == tmp_path / "ckpt"  # relative paths come back absolute


def test_local_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_checkpoint(str(tmp_path))


def test_hub_id_from_hf_hub_cache(hub_env):
    snapshot = _fake_hub_snapshot(hub_env, "Org/Tiny-Model")
    assert resolve_checkpoint("Org/Tiny-Model") == snapshot


def test_hub_id_from_hf_home(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hf_hub_cache() == tmp_path / "home" / "hub"
    snapshot = _fake_hub_snapshot(tmp_path / "home" / "hub", "Org/Other")
    assert resolve_checkpoint("Org/Other") == snapshot


def test_missing_hub_id_names_cache_and_fix(hub_env):
    with pytest.raises(FileNotFoundError) as info:
        resolve_checkpoint("Qwen/Qwen3-0.6B")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("model.path='Qwen/Qwen3-0.6B': no directory with config.json there")
    assert f"not in the local HF cache ({hub_env})" in message
    assert "`hf download Qwen/Qwen3-0.6B`" in message and "model.load_format=dummy" in message


@pytest.mark.parametrize("path", ["/nonexistent", "/no/such/dir", "./ckpt/model", "../ckpt", "~/ckpt/x",
                                  "ckpt/Qwen3/0.6B", "ckpt"])
def test_missing_path_that_is_no_hub_id_suggests_no_download(hub_env, path):
    with pytest.raises(FileNotFoundError) as info:
        resolve_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"model.path={path!r}: no such directory") and "hf download" not in message, message


@pytest.mark.parametrize("text,hub", [("Qwen/Qwen3-0.6B", True), ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
                                      ("org/name.v2_x", True), ("/nonexistent", False), ("/org/name", False),
                                      ("./org", False), ("../org/name", False), ("a/b/c", False), ("name", False),
                                      ("~/x", False), ("org/", False)])
def test_looks_like_hub_id(text, hub):
    assert looks_like_hub_id(text) is hub


def test_read_hf_config_merges_generation_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "eos_token_id": 2}))
    assert read_hf_config(tmp_path)["eos_token_id"] == 2
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert read_hf_config(tmp_path) == {"hidden_size": 8, "eos_token_id": [2, 7]}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    assert read_hf_config(tmp_path)["eos_token_id"] == 2


def test_read_hf_config_bad_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: invalid JSON"):
        read_hf_config(tmp_path)


def test_has_tokenizer(tmp_path):
    assert not has_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert not has_tokenizer(tmp_path)  # settings alone can't tokenize
    (tmp_path / "tokenizer.json").write_text("{}")
    assert has_tokenizer(tmp_path)
