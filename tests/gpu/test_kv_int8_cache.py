"""kv_cache_dtype=int8 on CUDA: the engine attends with the Triton kernels (CUDA graphs on); graphs replay the
eager tokens, and the first greedy tokens agree with torch attention over the same kind of cache."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.engine_setup import GPU, PROMPTS, greedy_tokens, make_llm, tiny_bf16_checkpoint

pytestmark = GPU


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_bf16_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def test_int8_engine_runs_triton_and_graphs_match_eager(checkpoint):
    tokens = []
    for eager in (True, False):
        llm = make_llm(checkpoint, kv_cache_dtype="int8", enforce_eager=eager)
        try:
            assert (llm.runner.graphs is None) == eager and llm.runner.spec.dtype == torch.int8
            assert {layer.backend for layer in llm.runner.model.attention_layers()} == {"triton"}
            tokens.append(greedy_tokens(llm, PROMPTS))
        finally:
            llm.close()
    assert tokens[0] == tokens[1]  # the same kernels, replayed


def test_int8_engine_first_tokens_match_the_torch_reference(checkpoint):
    results = []
    for backend in ("triton", "torch"):
        llm = make_llm(checkpoint, kv_cache_dtype="int8", attention_backend=backend)
        try:
            results.append(greedy_tokens(llm, PROMPTS))
        finally:
            llm.close()
    assert [t[:4] for t in results[0]] == [t[:4] for t in results[1]]
