import pytest

from spmd_engine.models.model_config import ModelShape

QWEN3_LIKE = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_scaling": None,
    "tie_word_embeddings": True, "eos_token_id": [151645, 151643], "torch_dtype": "bfloat16",
}


def test_reads_hf_config():
    shape = ModelShape.from_hf_config(QWEN3_LIKE)
    assert (shape.architecture, shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (
        "Qwen3ForCausalLM", 28, 16, 8, 128)
    assert (shape.rope_theta, shape.rope.rope_type, shape.tie_word_embeddings) == (1e6, "default", True)
    assert shape.eos_token_ids == [151645, 151643] and shape.torch_dtype == "bfloat16"


def test_defaults_and_alternative_spellings():
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": 100, "eos_token_id": 2, "dtype": "float16"}
    shape = ModelShape.from_hf_config(config)
    assert (shape.architecture, shape.num_kv_heads, shape.head_dim) == ("LlamaForCausalLM", 4, 16)
    assert (shape.eos_token_ids, shape.torch_dtype, shape.tie_word_embeddings) == ([2], "float16", False)


def test_missing_architecture_is_a_value_error():
    with pytest.raises(ValueError, match="architectures"):
        ModelShape.from_hf_config({**QWEN3_LIKE, "architectures": None})


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_valid_tensor_parallel_sizes(tp):
    shape = ModelShape.from_hf_config(QWEN3_LIKE)
    shape.validate_tensor_parallel(tp)
    assert shape.kv_heads_per_rank(tp) == max(1, 8 // tp)


@pytest.mark.parametrize("tp, field", [(3, "num_attention_heads=16"), (0, ">= 1")])
def test_invalid_heads_split(tp, field):
    with pytest.raises(ValueError, match=field):
        ModelShape.from_hf_config(QWEN3_LIKE).validate_tensor_parallel(tp)


def test_kv_heads_must_divide_or_be_replicated():
    shape = ModelShape.from_hf_config({**QWEN3_LIKE, "num_attention_heads": 24, "num_key_value_heads": 6})
    with pytest.raises(ValueError, match="must divide the model's num_key_value_heads=6"):
        shape.validate_tensor_parallel(4)
    shape = ModelShape.from_hf_config({**QWEN3_LIKE, "num_attention_heads": 24, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="multiple of the model's num_key_value_heads=3"):
        shape.validate_tensor_parallel(4)


def test_intermediate_size_must_split():
    with pytest.raises(ValueError, match="intermediate_size=3000"):
        ModelShape.from_hf_config({**QWEN3_LIKE, "intermediate_size": 3000}).validate_tensor_parallel(16)
