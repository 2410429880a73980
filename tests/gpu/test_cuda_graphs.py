"""Decode CUDA graphs give the eager engine's greedy tokens; the Triton and torch attention agree."""
import pytest

from tests.gpu.engine_setup import GPU, PROMPTS, greedy_tokens, make_llm, tiny_bf16_checkpoint

pytestmark = GPU
BF16_PREFIX = 4  # tokens that must agree in bf16 across attention backends


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_bf16_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module")
def eager_tokens(checkpoint):
    llm = make_llm(checkpoint, enforce_eager=True, attention_backend="triton")
    try:
        assert llm.runner.graphs is None
        return greedy_tokens(llm, PROMPTS)
    finally:
        llm.close()


def test_graphs_replay_and_match_eager(checkpoint, eager_tokens):
    llm = make_llm(checkpoint, attention_backend="triton")
    try:
        graphs = llm.runner.graphs
        assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
        assert greedy_tokens(llm, PROMPTS) == eager_tokens
        assert graphs.num_replays > 0
        replays = graphs.num_replays
        assert greedy_tokens(llm, PROMPTS[:3]) == eager_tokens[:3]  # 3 rows padded to the 4-row graph
        assert graphs.num_replays > replays
    finally:
        llm.close()


def test_torch_attention_matches_triton_in_float32(checkpoint):
    """float32: the two backends differ by rounding only, far below any logit gap: every token agrees."""
    results = []
    for backend in ("triton", "torch"):
        llm = make_llm(checkpoint, attention_backend=backend, dtype="float32")
        try:
            assert (llm.runner.graphs is None) == (backend == "torch")  # the torch reference is never captured
            results.append(greedy_tokens(llm, PROMPTS))
        finally:
            llm.close()
    assert results[0] == results[1]


def test_torch_attention_matches_triton_in_bf16(checkpoint, eager_tokens):
    """bf16: both round differently, so a near-tie far into a sequence may flip; the first tokens agree."""
    llm = make_llm(checkpoint, attention_backend="torch")
    try:
        tokens = greedy_tokens(llm, PROMPTS)
    finally:
        llm.close()
    assert [t[:BF16_PREFIX] for t in tokens] == [t[:BF16_PREFIX] for t in eager_tokens]
    print(f"bf16 triton vs torch: {sum(a == b for a, b in zip(tokens, eager_tokens))}/{len(PROMPTS)} prompts "
          f"identical over all {len(tokens[0])} tokens")


def test_block_size_that_spans_a_whole_tile(checkpoint, eager_tokens):
    llm = make_llm(checkpoint, block_size=256, num_kv_blocks=8)
    try:
        assert greedy_tokens(llm, PROMPTS) == eager_tokens
    finally:
        llm.close()
