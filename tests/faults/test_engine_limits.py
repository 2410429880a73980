"""Long inputs and a tight KV pool: the engine finishes at the limits instead of failing."""
from __future__ import annotations

import random

import pytest

from spmd_engine.models.model_config import ModelShape
from spmd_engine.config import ConfigError
from spmd_engine.engine import resolve_max_model_len
from tests.faults.engine_runs import greedy, make_llm, token_requests


def shape(max_pos: int, rope: dict | None = None) -> ModelShape:
    config = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 300, "max_position_embeddings": max_pos, "rope_theta": 10000.0}
    if rope:
        config["rope_scaling"] = rope
    return ModelShape.from_hf_config(config)


def test_max_model_len_beyond_the_positions_needs_rope_scaling():
    assert resolve_max_model_len(None, shape(128)) == 128
    assert resolve_max_model_len(None, shape(40960)) == 4096  # the default cap
    assert resolve_max_model_len(128, shape(128)) == 128
    with pytest.raises(ConfigError, match="max_model_len=129 exceeds the model's max_position_embeddings=128 "
                                          "and the model has no rope scaling"):
        resolve_max_model_len(129, shape(128))
    linear = shape(128, {"rope_type": "linear", "factor": 4.0})
    assert resolve_max_model_len(512, linear) == 512
    with pytest.raises(ConfigError, match="max_model_len=513 exceeds 512 positions, the most the model's linear"):
        resolve_max_model_len(513, linear)
    yarn = shape(128, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    assert resolve_max_model_len(256, yarn) == 256
    with pytest.raises(ConfigError, match="exceeds 256 positions"):
        resolve_max_model_len(257, yarn)


def test_the_engine_rejects_a_too_long_max_model_len_before_loading(fault_ckpt):
    with pytest.raises(ConfigError, match="max_model_len=256 exceeds the model's max_position_embeddings=128"):
        make_llm(fault_ckpt, max_model_len=256)


def test_prompt_plus_max_tokens_past_max_model_len_stops_at_the_limit(fault_ckpt):
    llm = make_llm(fault_ckpt, max_model_len=32, block_size=4)
    try:
        prompts = [list(range(3, 23)), list(range(3, 34)), list(range(3, 35)), [5, 6]]
        outs = llm.generate(token_requests(prompts, max_tokens=100))
    finally:
        llm.close()
    assert [o.finish_reason for o in outs] == ["length", "length", "error", "length"]
    assert [len(o.token_ids) for o in outs] == [12, 1, 0, 30]  # prompt + output == max_model_len
    assert "max_model_len=32 allows at most 31" in outs[2].error


def test_a_pool_of_a_few_sequences_completes_64_requests_by_preemption(fault_ckpt):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(3, 12))] for _ in range(64)]
    roomy = greedy(fault_ckpt, prompts, 10, max_model_len=32, block_size=4, num_kv_blocks=1024,
                   enable_prefix_caching=False)
    tight_llm = make_llm(fault_ckpt, max_model_len=32, block_size=4, num_kv_blocks=12, enable_prefix_caching=False)
    try:
        tight = tight_llm.generate(token_requests(prompts, max_tokens=10))
        preemptions = tight_llm.last_run["preemptions"]
    finally:
        tight_llm.close()
    assert [o.error for o in tight] == [None] * 64
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert all(len(o.token_ids) == 10 for o in tight)
    assert preemptions > 0
