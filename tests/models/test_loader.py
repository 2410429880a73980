import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from spmd_engine.models.loader import load_dummy_weights, load_safetensors_weights, safetensors_files
from spmd_engine.models.parallel import TensorParallel
from spmd_engine.models.registry import build_model
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="qwen3", num_kv_heads=1, tokenizer=False)


def config_of(path, **overrides):
    return {**json.loads((path / "config.json").read_text()), **overrides}


def rewrite(src, dst, edit):
    """Copy checkpoint `src` to `dst` with its tensors dict passed through `edit`."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def loaded(path, tp=TensorParallel.single(), **overrides):
    model = build_model(config_of(path, **overrides), tp)
    load_safetensors_weights(model, path)
    return model


def test_packed_parameters_hold_the_checkpoint_tensors(checkpoint):
    model, tensors = loaded(checkpoint), load_file(checkpoint / "model.safetensors")
    attn = model.model.layers[1].self_attn
    expected = torch.cat([tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(attn.qkv_proj.weight.data, expected)
    torch.testing.assert_close(attn.q_norm.weight.data, tensors["model.layers.1.self_attn.q_norm.weight"])
    torch.testing.assert_close(model.lm_head.weight.data, tensors["lm_head.weight"])


def test_sharded_index_checkpoint_loads_the_same(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(checkpoint).save_pretrained(tmp_path, max_shard_size="60KB")
    assert len(safetensors_files(tmp_path)) > 1
    single, sharded = loaded(checkpoint), loaded(tmp_path)
    for (name, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), name


def test_missing_tensor_is_named(checkpoint, tmp_path):
    path = rewrite(checkpoint, tmp_path / "c", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="missing 1 tensors of Qwen3ForCausalLM: model.layers.1.mlp.up_proj.weight"):
        loaded(path)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    extra = {"model.layers.7.mlp.up_proj.weight": torch.zeros(1)}
    path = rewrite(checkpoint, tmp_path / "c", lambda t: t.update(extra))
    with pytest.raises(ValueError, match="'model.layers.7.mlp.up_proj.weight' is not part of Qwen3ForCausalLM"):
        loaded(path)


def test_wrong_shape_is_named(checkpoint, tmp_path):
    path = rewrite(checkpoint, tmp_path / "c", lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\), expected \(64,\)"):
        loaded(path)


def test_rotary_buffers_are_ignored(checkpoint, tmp_path):
    path = rewrite(checkpoint, tmp_path / "c",
                   lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    loaded(path)


def test_untied_model_without_lm_head_uses_the_embedding(checkpoint, tmp_path):
    path = rewrite(checkpoint, tmp_path / "c", lambda t: t.pop("lm_head.weight"))
    model = loaded(path)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight.data, model.model.embed_tokens.weight.data)


def test_tied_model_ignores_a_saved_lm_head(checkpoint):
    model = loaded(checkpoint, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight.data, load_file(checkpoint / "model.safetensors")[
        "model.embed_tokens.weight"])


def test_directory_without_safetensors_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="holds no .safetensors files"):
        safetensors_files(tmp_path)


def test_dummy_weights_are_identical_for_every_tensor_parallel_size(checkpoint):
    config = config_of(checkpoint, vocab_size=301)
    full = build_model(config, TensorParallel.single())
    load_dummy_weights(full, seed=3)
    shards = [build_model(config, TensorParallel(rank, 2)) for rank in range(2)]
    for shard in shards:
        load_dummy_weights(shard, seed=3)
    down = [s.model.layers[0].mlp.down_proj.weight for s in shards]
    torch.testing.assert_close(torch.cat(down, dim=1), full.model.layers[0].mlp.down_proj.weight)
    embed = torch.cat([s.model.embed_tokens.weight for s in shards])
    torch.testing.assert_close(embed[:301], full.model.embed_tokens.weight)
    qkv = [s.model.layers[1].self_attn.qkv_proj for s in shards]
    k_rank1 = qkv[1].split(qkv[1].weight.data.T)[1].T  # one KV head, replicated on both ranks
    torch.testing.assert_close(k_rank1, full.model.layers[1].self_attn.qkv_proj.split(
        full.model.layers[1].self_attn.qkv_proj.weight.data.T)[1].T)


def test_dummy_weights_are_seeded_and_sensibly_scaled(checkpoint):
    a, b, c = (build_model(config_of(checkpoint), TensorParallel.single()) for _ in range(3))
    load_dummy_weights(a, seed=0)
    load_dummy_weights(b, seed=0)
    load_dummy_weights(c, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert abs(a.model.norm.weight.mean().item() - 1) < 0.05
    assert 0.015 < a.model.layers[0].mlp.gate_up_proj.weight.std().item() < 0.025
