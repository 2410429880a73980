"""`sampling.n`: several completions of one prompt (vLLM semantics), against HF and n=1 requests.

Child i of a request draws with seed + i, so it equals an n=1 request seeded seed + i; greedy children
equal HF's greedy tokens. The prompt is prefilled once (later children share its computed blocks), and
under a tiny pool with chunked prefill, async scheduling and preemption every child keeps its tokens.
"""
from __future__ import annotations

import random

import pytest

from spmd_engine.core.sequence import SamplingParams
from spmd_engine.job.prompts import PromptRequest
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint
from tests.spmd_engine.test_engine import hf_greedy, make_llm

NEW = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("n") / "ckpt", arch="qwen3", max_position_embeddings=128,
                                tokenizer=False)


def prompts(count: int = 3, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(21, 45))] for _ in range(count)]


def run(llm, requests: list[tuple[list[int], dict]]):
    outs = llm.generate([PromptRequest(i, None, p, dict(o)) for i, (p, o) in enumerate(requests)])
    assert [o.error for o in outs] == [None] * len(outs)
    return outs


def by_request(outs) -> dict[int, list[list[int]]]:
    grouped: dict[int, list[list[int]]] = {}
    for out in outs:
        grouped.setdefault(out.index, []).append(out.token_ids)
    return grouped


def test_greedy_children_equal_hf_and_each_other(ckpt):
    ps = prompts()
    expected = hf_greedy(ckpt, ps, NEW)
    llm = make_llm(ckpt, block_size=4, sampling={"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True})
    outs = run(llm, [(p, {"n": 4}) for p in ps])
    assert [(o.index, o.sample_index) for o in outs] == [(i, k) for i in range(3) for k in range(4)]
    assert by_request(outs) == {i: [e] * 4 for i, e in enumerate(expected)}


@pytest.mark.parametrize("seed", [7, 2**64 - 3])
def test_seeded_child_i_equals_an_n1_request_with_seed_plus_i(ckpt, seed):
    """Alone and in a mixed batch (other requests, greedy and sampled, around it)."""
    p, others = prompts(1, 1)[0], prompts(3, 2)
    sampled = {"temperature": 1.0, "top_p": 0.9, "max_tokens": NEW, "ignore_eos": True}
    llm = make_llm(ckpt, block_size=4, sampling=sampled)
    singles = [o.token_ids for o in run(llm, [(p, {"seed": (seed + i) % 2**64}) for i in range(4)])]
    assert len({tuple(t) for t in singles}) > 1  # the seeds draw different completions
    alone = run(llm, [(p, {"seed": seed, "n": 4})])
    assert [o.token_ids for o in alone] == singles and [o.sample_index for o in alone] == [0, 1, 2, 3]
    mixed = run(llm, [(others[0], {"temperature": 0.0}), (p, {"seed": seed, "n": 4}), (others[1], {"n": 2}),
                      (others[2], {"seed": 3})])
    assert by_request(mixed)[1] == singles


def test_n_under_a_tiny_pool_with_chunks_async_and_preemption_keeps_every_token(ckpt):
    ps = prompts(3, 3)
    sampled = {"temperature": 0.8, "top_k": 20, "max_tokens": 24, "ignore_eos": True}
    relaxed = make_llm(ckpt, block_size=4, num_kv_blocks=256, sampling=sampled)
    expected = by_request(run(relaxed, [(p, {"n": 8, "seed": 11 * i}) for i, p in enumerate(ps)]))
    for prefix_caching in (True, False):
        tight = make_llm(ckpt, block_size=4, num_kv_blocks=32, max_model_len=72, max_num_batched_tokens=16,
                         enable_prefix_caching=prefix_caching, async_scheduling=True, sampling=sampled)
        got = by_request(run(tight, [(p, {"n": 8, "seed": 11 * i}) for i, p in enumerate(ps)]))
        assert tight.last_run["preemptions"] > 0
        assert got == expected


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_prompt_is_prefilled_once_per_family(ckpt, prefix_caching):
    """Prompt tokens computed for an n=8 family: unique prompt tokens + the last prompt token per child (its
    logits), chunked or not: full blocks are shared, the partial last block copied."""
    block = 4
    ps = prompts(2, 4)
    for chunk in (8192, 16):
        llm = make_llm(ckpt, block_size=block, enable_prefix_caching=prefix_caching, max_num_batched_tokens=chunk,
                       sampling={"temperature": 0.0, "max_tokens": 4, "ignore_eos": True})
        run(llm, [(p, {"n": 8}) for p in ps])
        stats = llm.last_run
        unique = sum(len(p) for p in ps)
        assert stats["unique_prompt_tokens"] == unique
        assert stats["prompt_tokens_computed"] == unique + 7 * len(ps), stats
    # the same work as 8 separate n=1 requests admitted together prefills every copy
    llm = make_llm(ckpt, block_size=block, enable_prefix_caching=prefix_caching,
                   sampling={"temperature": 0.0, "max_tokens": 4, "ignore_eos": True})
    run(llm, [(p, {}) for p in ps for _ in range(8)])
    assert llm.last_run["prompt_tokens_computed"] > 4 * sum(len(p) for p in ps)


def test_a_bad_n_is_one_error_row():
    for bad in (0, -1, 1.5, "2", 10**9):
        with pytest.raises(ValueError, match="sampling.n must be an integer"):
            SamplingParams(n=bad).validate()


def test_the_python_api_returns_n_completions_per_prompt(ckpt):
    """`SamplingParams(n=3)`: one GenerationOutput per prompt, its completions indexed 0..2 (vLLM's shape)."""
    from spmd_engine import LLM

    llm = LLM(model=str(ckpt), device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64)
    ps = [{"prompt_token_ids": p} for p in prompts(2, 5)]
    singles = [llm.generate(ps, SamplingParams(temperature=1.0, max_tokens=6, seed=40 + i, ignore_eos=True))
               for i in range(3)]
    outs = llm.generate(ps, SamplingParams(temperature=1.0, max_tokens=6, seed=40, n=3, ignore_eos=True))
    llm.close()
    assert [o.request_id for o in outs] == [0, 1]
    for o in outs:
        assert [c.index for c in o.outputs] == [0, 1, 2]
        assert [c.token_ids for c in o.outputs] == [s[o.request_id].outputs[0].token_ids for s in singles]
