"""Qwen2, Mistral (with and without a sliding window) and Gemma 3 (mixed sliding / full layers, a local rope
base) logits against transformers' on tiny random checkpoints: prefill of 5-, 11- and 17-token prompts and 16
decode steps, windows shorter than the prompts."""
import pytest

from spmd_engine.models.model_config import ModelShape
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint
from tests.models.hf_parity import YARN, assert_matches_hf

GEMMA_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
GEMMA = dict(num_layers=3, extra_config={"sliding_window": 6, "layer_types": GEMMA_TYPES,
                                         "rope_local_base_freq": 100.0, "query_pre_attn_scalar": 24})
CASES = {
    "qwen2-kv2-untied": ("qwen2", dict(num_kv_heads=2, rope_theta=1e6)),
    "qwen2-kv1-tied-yarn": ("qwen2", dict(num_kv_heads=1, tie=True, rope_scaling=YARN)),
    "mistral-no-window": ("mistral", dict(extra_config={"sliding_window": None})),
    "mistral-window-5": ("mistral", dict(num_kv_heads=1, extra_config={"sliding_window": 5})),
    "gemma3-mixed-windows": ("gemma3", GEMMA),
    "gemma3-tied-softcap": ("gemma3", dict(tie=True, num_layers=3, extra_config={
        **GEMMA["extra_config"], "final_logit_softcapping": 3.0, "sliding_window": 3})),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_logits_match_transformers(tmp_path, case):
    arch, keys = case
    assert_matches_hf(make_tiny_checkpoint(tmp_path, arch=arch, tokenizer=False, **keys))


def test_layer_windows_follow_the_config():
    base = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "vocab_size": 50}
    assert ModelShape.from_hf_config({**base, "architectures": ["MistralForCausalLM"],
                                      "sliding_window": 7}).layer_windows == (7,) * 4
    no_window = ModelShape.from_hf_config({**base, "model_type": "mistral", "sliding_window": None})
    assert no_window.layer_windows == (0,) * 4 and no_window.architecture == "MistralForCausalLM"
    qwen2 = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 9, "max_window_layers": 2}
    assert ModelShape.from_hf_config({**qwen2, "use_sliding_window": False}).layer_windows == (0,) * 4
    assert ModelShape.from_hf_config({**qwen2, "use_sliding_window": True}).layer_windows == (0, 0, 9, 9)
    gemma = {**base, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 5, "sliding_window_pattern": 2,
             "rope_theta": 1e6, "rope_local_base_freq": 1e4}
    shape = ModelShape.from_hf_config(gemma)
    assert shape.layer_windows == (5, 0, 5, 0) and shape.rope.theta == 1e6 and shape.local_rope.theta == 1e4
    with pytest.raises(ValueError, match="layer_types must list 4 entries"):
        ModelShape.from_hf_config({**gemma, "layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        ModelShape.from_hf_config({**gemma, "sliding_window": None, "layer_types": ["sliding_attention"] * 4})


@pytest.mark.parametrize("case", ["mistral-window-5", "gemma3-mixed-windows"])
def test_triton_backend_matches_torch(tmp_path, case):
    """The Triton kernels (the interpreter on CPU) with the sliding windows: the torch backend's logits and
    tokens, prefill and decode."""
    import json

    import torch

    from spmd_engine.models.loader import load_safetensors_weights
    from spmd_engine.models.parallel import TensorParallel
    from spmd_engine.models.registry import build_model
    from tests.models.hf_parity import PROMPTS, relative_error
    from tests.models.paged_runner import run_paged

    arch, keys = CASES[case]
    path = make_tiny_checkpoint(tmp_path, arch=arch, tokenizer=False, **keys)
    runs = []
    for backend in ("torch", "triton"):
        model = build_model(json.loads((path / "config.json").read_text()), TensorParallel.single(), backend)
        load_safetensors_weights(model, path)
        runs.append(run_paged(model, PROMPTS, 6))
    ref, ours = runs
    assert relative_error(torch.cat(ours.prefill_logits), torch.cat(ref.prefill_logits)) < 1e-5
    assert all(relative_error(a, b) < 1e-5 for a, b in zip(ours.decode_logits, ref.decode_logits))
    assert ours.generated == ref.generated


@pytest.mark.parametrize("group", ["gemma3", "qwen2_5_7b", "mistral_7b"])
def test_model_groups_build_on_the_meta_device(group):
    """The conf/model shapes build (no memory: meta tensors) with the windows their configs give."""
    from pathlib import Path

    import torch
    import yaml

    from spmd_engine.models.parallel import TensorParallel
    from spmd_engine.models.registry import build_model

    conf = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf" / "model" / f"{group}.yaml").read_text())
    with torch.device("meta"):
        model = build_model(conf["hf_config"], TensorParallel.single())
    windows = [layer.window for layer in model.attention_layers()]
    expected = {"gemma3": [0 if (i + 1) % 6 == 0 else 512 for i in range(18)], "qwen2_5_7b": [0] * 28,
                "mistral_7b": [4096] * 32}[group]
    assert windows == expected
