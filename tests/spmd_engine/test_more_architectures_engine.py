"""Qwen2, Mistral with a sliding window and Gemma 3 with mixed sliding / full layers through the engine: greedy
tokens equal HF's (fp32) with prefix caching, chunked prefill, and a tiny KV pool with preemption under async
scheduling; and 2 tensor-parallel ranks give one rank's logits. The windows (5 and 6 positions) are shorter
than most prompts, so the cached prefixes and the chunks cross them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.spawned_ranks import run_on_ranks
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint
from tests.models.hf_parity import relative_error
from tests.models.test_tensor_parallel import STEPS, _worker, run_scenarios
from tests.spmd_engine.test_engine import NEW_TOKENS, PROMPTS, cached, generate, hf_greedy, make_llm, tokens

GEMMA_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
ARCHS = {
    "qwen2": dict(arch="qwen2", num_kv_heads=1),
    "mistral-window": dict(arch="mistral", extra_config={"sliding_window": 5}),
    "gemma3-mixed": dict(arch="gemma3", num_layers=3, tie=True,
                         extra_config={"sliding_window": 6, "layer_types": GEMMA_TYPES,
                                       "rope_local_base_freq": 100.0, "query_pre_attn_scalar": 24}),
}


@pytest.fixture(scope="module", params=["mistral-window", "gemma3-mixed"])
def tiny(request, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", max_position_embeddings=128,
                                tokenizer=False, **ARCHS[request.param])
    return path, hf_greedy(path, PROMPTS, NEW_TOKENS)


def test_qwen2_greedy_matches_hf(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "qwen2", max_position_embeddings=128, tokenizer=False, **ARCHS["qwen2"])
    llm = make_llm(path, block_size=4, max_num_batched_tokens=16)
    assert tokens(generate(llm, PROMPTS)) == hf_greedy(path, PROMPTS, NEW_TOKENS)


def test_prefix_caching_matches_hf(tiny):
    path, expected = tiny
    llm = make_llm(path, block_size=4, enable_prefix_caching=True)
    assert tokens(generate(llm, PROMPTS)) == expected
    second = generate(llm, PROMPTS)
    assert tokens(second) == expected and cached(second) > 0


def test_chunked_prefill_matches_hf(tiny):
    path, expected = tiny
    llm = make_llm(path, block_size=4, max_num_batched_tokens=8)
    assert tokens(generate(llm, PROMPTS)) == expected
    assert llm.last_run["steps"] > NEW_TOKENS


def test_tiny_pool_preemption_async_matches_hf(tiny):
    path, expected = tiny
    llm = make_llm(path, block_size=4, num_kv_blocks=16, max_model_len=64, async_scheduling=True)
    assert tokens(generate(llm, PROMPTS)) == expected
    assert llm.last_run["preemptions"] > 0


def test_two_ranks_match_one(tmp_path):
    checkpoints = {name: make_tiny_checkpoint(tmp_path / name, tokenizer=False, **keys)
                   for name, keys in ARCHS.items() if name != "qwen2"}
    out = tmp_path / "tp2.pt"
    run_on_ranks(_worker, (checkpoints, out))
    sharded, single = torch.load(out), run_scenarios(checkpoints, _single())
    assert sharded.keys() == single.keys()
    for name, ours in sharded.items():
        assert len(ours) == STEPS + 1
        for step, (a, b) in enumerate(zip(ours, single[name])):
            assert a.shape == b.shape and relative_error(a, b) < 1e-5, f"{name} step {step}"


def _single():
    from spmd_engine.models.parallel import TensorParallel

    return TensorParallel.single()


def test_bench_floor_counts_a_sliding_layer_window_only():
    from spmd_engine.job.bench_report import _keys_read, _prefill_pairs

    for p, n, window in [(10, 5, 0), (10, 5, 12), (10, 5, 3), (100, 300, 256), (8192, 256, 512), (1, 1, 4)]:
        assert _keys_read(p, n, window) == sum(min(p + j, window or p + j) for j in range(1, n))
    assert _prefill_pairs(1000, 0) == _prefill_pairs(1000, 1000) == 500_000
    assert _prefill_pairs(1000, 100) == 100 * 100 / 2 + 900 * 100
