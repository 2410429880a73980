import pytest
import torch

from spmd_engine.models.layers.attention import Attention
from spmd_engine.models.llama import LlamaForCausalLM
from spmd_engine.models.parallel import TensorParallel
from spmd_engine.models.qwen3 import Qwen3ForCausalLM
from spmd_engine.models.registry import build_model

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 50, "max_position_embeddings": 32}


@pytest.mark.parametrize("arch, cls", [("Qwen3ForCausalLM", Qwen3ForCausalLM), ("LlamaForCausalLM", LlamaForCausalLM)])
def test_builds_the_named_architecture(arch, cls):
    model = build_model({**TINY, "architectures": [arch]}, TensorParallel.single())
    assert type(model) is cls and model.shape.architecture == arch
    assert len(model.attention_layers()) == 3


def test_parameters_follow_the_callers_device_and_dtype():
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = build_model({**TINY, "architectures": ["LlamaForCausalLM"]}, TensorParallel.single())
    finally:
        torch.set_default_dtype(torch.float32)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_bind_kv_cache_gives_each_layer_its_pair():
    model = build_model({**TINY, "architectures": ["Qwen3ForCausalLM"]}, TensorParallel.single())
    caches = [(torch.zeros(1), torch.ones(1)) for _ in range(3)]
    model.bind_kv_cache(caches)
    assert all(layer.k_cache is k and layer.v_cache is v for layer, (k, v) in zip(model.attention_layers(), caches))
    assert all(isinstance(layer, Attention) for layer in model.attention_layers())
    with pytest.raises(ValueError, match="2 KV caches for 3 attention layers"):
        model.bind_kv_cache(caches[:2])


def test_unsupported_architecture_lists_supported_ones():
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; supported: Gemma3ForCausalLM, "
                                         "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3"):
        build_model({**TINY, "architectures": ["GPT2LMHeadModel"]}, TensorParallel.single())


def test_tensor_parallel_size_is_validated():
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        build_model({**TINY, "architectures": ["LlamaForCausalLM"]}, TensorParallel(0, 3))


@pytest.mark.parametrize("extra, message", [({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
                                            ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_variants_are_rejected(extra, message):
    with pytest.raises(ValueError, match=message):
        build_model({**TINY, "architectures": ["Qwen3ForCausalLM"], **extra}, TensorParallel.single())
