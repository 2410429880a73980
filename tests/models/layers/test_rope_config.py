import pytest

from spmd_engine.models.layers.rope_config import RopeConfig


def test_plain_config_reads_top_level_theta():
    rope = RopeConfig.from_hf_config({"rope_theta": 1e6, "rope_scaling": None, "max_position_embeddings": 8})
    assert rope == RopeConfig(rope_type="default", theta=1e6)


def test_legacy_rope_scaling_with_type_key():
    rope = RopeConfig.from_hf_config({"rope_theta": 5e5, "max_position_embeddings": 128,
                                      "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    assert (rope.rope_type, rope.theta, rope.factor) == ("dynamic", 5e5, 2.0)


def test_rope_parameters_hold_theta_and_default_original_length():
    rope = RopeConfig.from_hf_config({"max_position_embeddings": 4096, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}})
    assert (rope.theta, rope.original_max_position_embeddings, rope.beta_fast, rope.beta_slow) == (1e6, 4096, 32, 1)


def test_top_level_original_length_wins_like_transformers():
    rope = RopeConfig.from_hf_config({"max_position_embeddings": 4096, "original_max_position_embeddings": 1024,
                                      "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1,
                                                          "high_freq_factor": 4,
                                                          "original_max_position_embeddings": 2048}})
    assert rope.original_max_position_embeddings == 1024


def test_yarn_factor_defaults_to_context_ratio():
    rope = RopeConfig.from_hf_config({"max_position_embeddings": 4096, "rope_parameters": {
        "rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024}})
    assert rope.factor == 4.0


def test_unsupported_type_is_a_one_line_value_error():
    with pytest.raises(ValueError, match=r"rope_scaling.rope_type must be one of .*'longrope'"):
        RopeConfig.from_hf_config({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}})


def test_missing_llama3_field_names_it():
    with pytest.raises(ValueError, match="rope_parameters.low_freq_factor is required"):
        RopeConfig.from_hf_config({"max_position_embeddings": 64, "rope_parameters": {
            "rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}})


def test_partial_rotary_is_rejected():
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        RopeConfig.from_hf_config({"partial_rotary_factor": 0.5, "rope_theta": 1e4})


def test_rope_scaling_takes_precedence_like_transformers():
    rope = RopeConfig.from_hf_config({"rope_theta": 7.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                      "rope_parameters": {"rope_type": "default", "rope_theta": 5.0}})
    assert (rope.rope_type, rope.factor, rope.theta) == ("linear", 2.0, 7.0)
