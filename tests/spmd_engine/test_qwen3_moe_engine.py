"""A tiny random Qwen3-MoE checkpoint through the whole engine: greedy tokens equal HF generate's (fp32), plain,
and with chunked prefill in a tiny KV pool with recompute preemption and async scheduling."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tiny_checkpoints import make_tiny_checkpoint
from tests.spmd_engine.test_engine import PROMPTS, generate, hf_greedy, make_llm, tokens

NEW_TOKENS = 32  # test_engine's max_tokens


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "ckpt", arch="qwen3_moe", max_position_embeddings=128,
                                tokenizer=False, moe=dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False))
    return path, hf_greedy(path, PROMPTS, NEW_TOKENS)


def test_greedy_matches_hf(tiny_moe):
    path, expected = tiny_moe
    assert tokens(generate(make_llm(path, block_size=4), PROMPTS)) == expected


def test_chunked_prefill_and_preemption_in_a_tiny_pool_match_hf_with_async_scheduling(tiny_moe):
    path, expected = tiny_moe
    llm = make_llm(path, block_size=4, num_kv_blocks=16, max_model_len=64, max_num_batched_tokens=8,
                   async_scheduling=True)
    longest = [1, 3, 4]  # 25-31 prompt tokens + 32 new: up to 16 blocks each, 16 in the pool
    outs = generate(llm, [PROMPTS[i] for i in longest])
    assert llm.last_run["preemptions"] > 0 and llm.last_run["steps"] > NEW_TOKENS  # preempted, chunked
    assert tokens(outs) == [expected[i] for i in longest]
