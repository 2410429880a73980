import json
import os

import pytest

from spmd_engine.config import ConfigError
from spmd_engine.faults.preflight import check_checkpoint_files, check_prompts_file


def test_weights_missing_on_this_node(tmp_path):
    check_checkpoint_files(None)  # dummy weights: nothing to check
    with pytest.raises(ConfigError, match="holds no .safetensors files"):
        check_checkpoint_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError, match="1 of 2 weight files are missing or unreadable on this node, "
                                          "e.g. model-00002-of-00002.safetensors"):
        check_checkpoint_files(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x")
    check_checkpoint_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ConfigError):
        check_checkpoint_files(tmp_path)


def test_prompts_file(tmp_path):
    check_prompts_file(None)
    with pytest.raises(ConfigError, match="prompts_file='nope.jsonl': no such file"):
        check_prompts_file("nope.jsonl")
    path = tmp_path / "p.jsonl"
    path.write_text("{}\n")
    check_prompts_file(str(path))
    if os.geteuid() != 0:  # root reads anything
        path.chmod(0)
        with pytest.raises(ConfigError, match="not readable"):
            check_prompts_file(str(path))


@pytest.mark.parametrize("shard", ["../outside.safetensors", "sub/../../outside.safetensors", "/etc/passwd", "", 7,
                                   None, "."])
def test_the_shard_index_only_names_files_inside_the_checkpoint(tmp_path, shard):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(b"x")  # exists and is readable: it must still be refused
    (ckpt / "inside.safetensors").write_bytes(b"x")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "inside.safetensors",
                                                                                  "b": shard}}))
    with pytest.raises(ConfigError, match=r"model.safetensors.index.json names shard .* which is not a file inside "
                                          r"the checkpoint dir") as info:
        check_checkpoint_files(ckpt)
    assert "\n" not in str(info.value)
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "nested.safetensors").write_bytes(b"x")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "inside.safetensors",
                                                                                  "b": "sub/./nested.safetensors"}}))
    check_checkpoint_files(ckpt)  # a subdirectory of the checkpoint is inside it
