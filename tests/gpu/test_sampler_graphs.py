"""Sampler graphs on the GPU (executor/sampler_graphs.py, engine key `sampler_graphs`): the replayed draws are
the eager sampler's tokens bit for bit (every batch size, padding rows ignored, a row's token independent of
its batch), an engine samples the same tokens with the key on and off, and uniform decode steps do take
the graphs."""
import numpy as np
import pytest
import torch

from spmd_engine.executor.cuda_graphs import smallest_holding
from spmd_engine.executor.sampler import Sampler, SamplingBatch
from spmd_engine.executor.sampler_graphs import SamplerGraphs, sampler_graph_bytes
from spmd_engine.job.prompts import PromptRequest
from tests.gpu.engine_setup import GPU, PROMPTS, make_llm, tiny_bf16_checkpoint

pytestmark = GPU
SIZES = [1, 2, 4, 8, 16, 32, 48]


def batch(n: int, rng: np.random.Generator, greedy: bool, top_k: bool = False) -> SamplingBatch:
    temps = np.zeros(n) if greedy else rng.uniform(0.05, 3.0, n)
    top_ks = rng.integers(1, 33, n, dtype=np.int64) if top_k else np.full(n, -1, dtype=np.int64)
    top_ps = rng.choice([1.0, 0.95, 0.5], n) if top_k else np.ones(n)
    return SamplingBatch(rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64), rng.integers(0, 5000, n, dtype=np.int64),
                         temps, top_ps, top_ks)


def static_logits(vocab: int) -> dict[int, torch.Tensor]:
    """Per size a [rows, vocab] view of a wider buffer, as the LM head's `[:, :vocab]` of a padded vocabulary."""
    return {rows: torch.empty(rows, vocab + 64, device="cuda")[:, :vocab] for rows in SIZES}


@pytest.mark.parametrize("vocab", [151936, 1000])
@pytest.mark.parametrize("greedy,top_k", [(False, False), (True, False), (False, True)])
def test_replayed_draws_are_the_eager_samplers_tokens(vocab, greedy, top_k):
    logits = static_logits(vocab)
    graphs = SamplerGraphs.capture(logits)
    sampler = Sampler(torch.device("cuda"))
    rng = np.random.default_rng(vocab + greedy + 2 * top_k)
    try:
        for trial, n in enumerate([1, 2, 3, 4, 5, 8, 9, 16, 17, 31, 32, 33, 47, 48] * 3):
            rows = smallest_holding(SIZES, n)
            static = logits[rows]
            static.copy_(torch.randn(rows, vocab, device="cuda") * (0.5 + trial % 4))
            b = batch(n, rng, greedy, top_k)
            expected = sampler.sample_on_device(static[:n], b).clone()
            static[n:] = float("nan") if trial % 2 else 1e4  # padding rows: anything
            replays = graphs.num_replays
            got = graphs.sample(rows, b)
            assert got is not None and graphs.num_replays == replays + 1
            assert torch.equal(got, expected), (n, rows)
    finally:
        graphs.close()


def test_a_row_draws_the_same_token_alone_and_padded_into_any_graph():
    vocab = 32000
    logits = static_logits(vocab)
    graphs = SamplerGraphs.capture(logits)
    rng = np.random.default_rng(1)
    row = torch.randn(vocab, device="cuda") * 2
    alone = batch(1, rng, greedy=False)
    try:
        logits[1][0] = row
        token = graphs.sample(1, alone).item()
        for n, at in ((3, 2), (8, 0), (33, 20), (48, 47)):
            rows = smallest_holding(SIZES, n)
            logits[rows].copy_(torch.randn(rows, vocab, device="cuda"))
            logits[rows][at] = row
            b = batch(n, rng, greedy=False)
            b.seeds[at], b.counters[at], b.temperatures[at] = alone.seeds[0], alone.counters[0], alone.temperatures[0]
            assert graphs.sample(rows, b)[at].item() == token
    finally:
        graphs.close()


def test_capture_keeps_no_more_memory_than_the_budget_counts():
    vocab = 151936
    logits = static_logits(vocab)
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    graphs = SamplerGraphs.capture(logits)
    try:
        torch.cuda.synchronize()
        assert torch.cuda.memory_reserved() - reserved <= sampler_graph_bytes(SIZES, vocab)
    finally:
        graphs.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_bf16_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def outputs(llm, prompts, **params) -> list[list[int]]:
    outs = llm.generate([PromptRequest(i, None, p, {"max_tokens": 16, "ignore_eos": True, **params})
                         for i, p in enumerate(prompts)])
    assert [o.error for o in outs] == [None] * len(prompts)
    return [o.token_ids for o in outs]


UNIFORM = [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 1.0, "seed": 7}, {"temperature": 1.2, "top_p": 1.0},
           {"temperature": 0.6, "top_p": 1.0, "top_k": 20}, {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "seed": 7}]
EAGER = [{"temperature": 0.8, "top_p": 0.9, "seed": 7}, {"temperature": 0.8, "top_p": 1.0, "top_k": 40},
         {"temperature": 0.8, "top_p": 1.0, "logprobs": 1}]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_an_engine_samples_the_same_tokens_with_the_key_on_and_off(checkpoint, async_scheduling):
    off = make_llm(checkpoint, debug={"sampler_graphs": False}, async_scheduling=async_scheduling)
    try:
        assert off.runner.graphs is not None and off.runner.sampler_graphs is None
        expected = [[outputs(off, prompts, **params) for prompts in (PROMPTS, PROMPTS[:3], PROMPTS[2:3])]
                    for params in UNIFORM + EAGER]
    finally:
        off.close()
    on = make_llm(checkpoint, debug={"sampler_graphs": True}, async_scheduling=async_scheduling)
    try:
        graphs = on.runner.sampler_graphs
        assert graphs is not None and graphs.sizes == on.runner.graphs.sizes == [1, 2, 4, 8]
        for params, want in zip(UNIFORM + EAGER, expected):
            replays = graphs.num_replays
            assert [outputs(on, prompts, **params) for prompts in (PROMPTS, PROMPTS[:3], PROMPTS[2:3])] == want, params
            if params in UNIFORM:  # the decode steps took the graphs
                assert graphs.num_replays > replays and on.last_run["sampler_graph_steps"] > 0, params
            else:
                assert graphs.num_replays == replays and on.last_run["sampler_graph_steps"] == 0, params
    finally:
        on.close()


def test_no_sampler_graphs_without_decode_graphs(checkpoint):
    llm = make_llm(checkpoint, enforce_eager=True)
    try:
        assert llm.runner.graphs is None and llm.runner.sampler_graphs is None
    finally:
        llm.close()
