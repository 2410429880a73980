"""The sampler graphs' host side, run eagerly on CPU (`SamplerGraphs.eager`: the same static buffers,
key staging and path choice, each draw run instead of replayed): the eager sampler's tokens, padding
rows ignored, every non-uniform step left to the eager sampler, and the engine's routing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from spmd_engine.config import engine_config_from_dict
from spmd_engine.distributed import RankInfo
from spmd_engine.engine import Engine
from spmd_engine.executor.cuda_graphs import smallest_holding
from spmd_engine.executor.sampler import (GRAPH_TOP_K_MAX, MIN_TEMPERATURE, Sampler, SamplingBatch, _KeyStaging,
                                          uniform_kind)
from spmd_engine.executor.sampler_graphs import (PAD_COUNTER, PAD_SEED, PAD_TEMPERATURE, KeyViews, SamplerGraphs,
                                                 pack_keys)
from spmd_engine.job.prompts import PromptRequest
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

CPU = torch.device("cpu")
VOCAB = 301


def batch(n: int, temperature: float | list[float] = 0.8, top_p: float = 1.0, top_k: int = -1, seed0: int = 0,
          counter0: int = 0) -> SamplingBatch:
    temps = temperature if isinstance(temperature, list) else [temperature] * n
    rng = np.random.default_rng(seed0)
    return SamplingBatch(rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64),
                         np.arange(counter0, counter0 + n, dtype=np.int64), np.array(temps, dtype=np.float64),
                         np.full(n, top_p), np.full(n, top_k, dtype=np.int64))


def static_logits(sizes: list[int], seed: int = 0) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {rows: torch.randn(rows, VOCAB, generator=gen) * 3 for rows in sizes}


def test_pack_keys_lays_out_seeds_counters_temperatures_and_pads_the_rest():
    b = batch(3, temperature=[0.5, 1.25, 2.0], seed0=7, counter0=40)
    packed = pack_keys(b, 6)
    assert packed.dtype == np.int64 and packed.shape == (3 * 8,)  # 6 rows -> sections of 8 (32-byte aligned)
    keys = KeyViews.of(torch.from_numpy(packed), 6)
    assert keys.seeds.tolist() == b.seeds.tolist() + [PAD_SEED] * 3
    assert keys.counters.tolist() == [40, 41, 42] + [PAD_COUNTER] * 3
    assert keys.temperatures.dtype == torch.float32
    assert keys.temperatures.tolist() == [0.5, 1.25, 2.0] + [PAD_TEMPERATURE] * 3
    for section in (keys.seeds, keys.counters, keys.temperatures):
        assert section.storage_offset() * section.element_size() % 32 == 0
    with pytest.raises(ValueError, match="does not fit"):
        pack_keys(batch(7), 6)
    with pytest.raises(ValueError, match="does not fit"):
        pack_keys(batch(0), 6)


def test_only_all_greedy_all_plain_or_all_narrow_top_k_batches_are_uniform():
    assert uniform_kind(batch(4, temperature=0.0)) == "greedy"
    assert uniform_kind(batch(4, temperature=MIN_TEMPERATURE / 2)) == "greedy"
    assert uniform_kind(batch(4, temperature=0.7)) == "plain"
    assert uniform_kind(batch(4, temperature=[0.0, 0.7, 0.7, 0.7])) is None  # a mix of paths
    assert uniform_kind(batch(4, top_p=0.9)) is None
    assert uniform_kind(batch(4, top_k=20)) == "top_k"  # Qwen3's defaults, with and without top-p
    assert uniform_kind(batch(4, top_k=20, top_p=0.95)) == "top_k"
    assert uniform_kind(batch(4, top_k=GRAPH_TOP_K_MAX)) == "top_k"
    assert uniform_kind(batch(4, top_k=GRAPH_TOP_K_MAX + 1)) is None  # past the graphs' kernel capacity
    assert uniform_kind(batch(4, temperature=0.0, top_p=0.9)) == "greedy"  # greedy whatever its top-p
    assert uniform_kind(batch(0)) is None


def test_the_graphs_top_k_capacity_is_the_kernels_smaller_one():
    from spmd_engine.kernels.top_k_sample import K_CAPS
    assert GRAPH_TOP_K_MAX == K_CAPS[0]


def test_pack_keys_of_a_top_k_graph_adds_top_k_and_float64_top_p():
    b = batch(3, temperature=[0.5, 1.25, 2.0], top_p=0.95, top_k=20, seed0=7, counter0=40)
    b.top_k[1] = 3
    packed = pack_keys(b, 6, "top_k")
    assert packed.shape == (5 * 8,)
    keys = KeyViews.of(torch.from_numpy(packed), 6, "top_k")
    assert keys.packed.shape == (40,) and keys.top_p.dtype == torch.float64
    assert keys.top_k.tolist()[:3] == [20, 3, 20] and keys.top_p.tolist()[:3] == [0.95] * 3  # not float32's 0.95
    assert keys.temperatures.tolist() == [0.5, 1.25, 2.0] + [PAD_TEMPERATURE] * 3
    assert pack_keys(b, 6, "plain").tolist() == packed[:24].tolist()


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.0, 1.0, -1), (0.3, 1.0, -1), (1.0, 1.0, -1),
                                                     ([0.5, 1.7, 0.9, 3.0, 1.1, 0.2, 0.8, 1.4], 1.0, -1),
                                                     (0.6, 1.0, 20), (0.6, 0.95, 20), (1.3, 0.5, 1),
                                                     ([0.5, 1.7, 0.9, 3.0, 1.1, 0.2, 0.8, 1.4], 0.8, 32)])
def test_graph_path_draws_the_eager_samplers_tokens_and_ignores_padding_rows(temperature, top_p, top_k):
    sizes = [1, 2, 4, 8]
    logits = static_logits(sizes)
    graphs = SamplerGraphs.eager(logits)
    eager = Sampler(CPU)
    for step, n in enumerate([1, 2, 3, 4, 5, 7, 8]):
        rows = smallest_holding(sizes, n)
        temps = temperature[:n] if isinstance(temperature, list) else temperature
        b = batch(n, temps, top_p=top_p, top_k=top_k, seed0=step, counter0=3 * step)
        if top_k > 1:
            b.top_k[:] = np.arange(n) % top_k + 1  # mixed k per row
        expected = eager.sample_on_device(logits[rows][:n].clone(), b)
        logits[rows][n:] = torch.randn(rows - n, VOCAB) * 50  # padding rows: anything
        got = graphs.sample(rows, b)
        assert got is not None and got.shape == (n,) and got.dtype == torch.int64
        assert torch.equal(got, expected), (n, rows)
    assert graphs.num_replays == 7


def test_a_row_draws_the_same_token_in_any_graph_and_position():
    """The determinism rule on the graph path: a row's token depends on its own logits and keys only."""
    sizes = [1, 4, 8]
    logits = static_logits(sizes)
    row_logits = torch.randn(VOCAB) * 2
    graphs = SamplerGraphs.eager(logits)
    alone = batch(1, 0.9, seed0=5, counter0=11)
    logits[1][0] = row_logits
    token = graphs.sample(1, alone).item()
    for rows, n, at in ((4, 3, 2), (8, 8, 5), (8, 5, 0)):
        b = batch(n, 0.9, seed0=rows + at, counter0=0)
        b.seeds[at], b.counters[at] = alone.seeds[0], alone.counters[0]
        logits[rows][at] = row_logits
        assert graphs.sample(rows, b)[at].item() == token


def test_steps_without_a_uniform_graph_queue_nothing():
    logits = static_logits([1, 4])
    graphs = SamplerGraphs.eager(logits)
    before = graphs.keys.clone()
    for rows, b in ((4, batch(3, top_p=0.9)), (4, batch(3, top_k=GRAPH_TOP_K_MAX + 1)),
                    (4, batch(2, temperature=[0.0, 1.0])),
                    (2, batch(2)),  # no 2-row graph
                    (1, batch(2)),  # more rows than the graph
                    (4, batch(0))):
        assert graphs.sample(rows, b) is None
    assert graphs.num_replays == 0 and torch.equal(graphs.keys, before)


def test_a_plain_step_stages_its_keys_into_the_static_buffer_and_a_greedy_one_reads_none():
    logits = static_logits([4, 8])
    graphs = SamplerGraphs.eager(logits)
    b = batch(3, [0.5, 0.6, 0.7], seed0=3, counter0=9)
    graphs.sample(4, b)
    assert graphs.keys[:12].tolist() == pack_keys(b, 4).tolist()
    assert graphs.keys[12:].abs().sum().item() != 0  # the 8-row layout's tail (initial temperatures): untouched
    staged = graphs.keys.clone()
    graphs.sample(8, batch(5, temperature=0.0))
    assert torch.equal(graphs.keys, staged)


def test_key_staging_copies_into_a_given_buffer_of_its_size_only():
    staging = _KeyStaging(CPU)
    into = torch.zeros(6, dtype=torch.int64)
    packed = np.arange(6, dtype=np.int64)
    assert staging.put(packed, into=into) is into and into.tolist() == list(range(6))
    with pytest.raises(ValueError, match="int64"):
        staging.put(packed, into=torch.zeros(5, dtype=torch.int64))
    assert staging.put(packed).tolist() == list(range(6))  # no destination: a new tensor, as before


def test_the_memory_budget_counts_every_graphs_tokens_and_the_race_scratch():
    from spmd_engine.executor.sampler_graphs import sampler_graph_bytes

    vocab, sizes = 151936, [1, 2, 4, 8, 16, 32]
    tokens = sum(2 * rows * 8 for rows in sizes)  # the race's tokens, the greedy argmax
    scratch = 256 * (8 + 4)  # the fused race's per-row scratch (at least 256 rows)
    assert sampler_graph_bytes(sizes, vocab) >= tokens + scratch + 3 * 32 * 8 + 2 * (2 << 20)
    assert sampler_graph_bytes(sizes + [256], vocab) - sampler_graph_bytes(sizes, vocab) >= 2 * 256 * 8
    assert sampler_graph_bytes([], vocab) == 0
    # a graph of 200,000 rows: its blocks pass 1 MiB, large blocks in a 20 MiB segment
    assert sampler_graph_bytes([200_000], vocab) >= 200_000 * (8 + 8 + 12) + (20 << 20)


# --- the engine's routing, with the decode graphs' static logits emulated on CPU --------------------------
SINGLE = RankInfo(0, 1, 0, "127.0.0.1", 0, "single")
PROMPTS = [[5, 6, 7], list(range(40, 65)), [9] * 10 + [11], list(range(20, 45)), [3, 4]]
SIZES = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sg") / "ckpt", arch="qwen3", max_position_embeddings=128,
                                tokenizer=False)


def make_llm(path, emulate_graphs: bool) -> Engine:
    """A CPU engine; `emulate_graphs`: pure decode steps return their logits as the first rows of a static
    [rows, vocab] buffer per padded size (as DecodeGraphs.replay does, padding rows filled with noise) and
    the runner holds eager sampler graphs over those buffers."""
    raw = {"model": {"name": "tiny", "path": str(path), "load_format": "auto", "hf_config": {}},
           "workload": {"name": "chat"}, "sampling": {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True},
           "device": "cpu", "dtype": "float32", "num_kv_blocks": 256, "max_num_seqs": 8}
    llm = Engine(engine_config_from_dict(raw), SINGLE)
    assert llm.runner.sampler_graphs is None  # CPU: the key is a silent no-op
    if emulate_graphs:
        runner = llm.runner
        static = {rows: torch.zeros(rows, llm.shape.vocab_size) for rows in SIZES}
        launch = runner.launch

        def static_launch(staged, prev_tokens=None):
            logits = launch(staged, prev_tokens)
            host = staged.host
            if not host.is_decode or logits is None or len(host.logits_indices) != host.num_seqs:
                return logits
            n = host.num_seqs
            staged.graph_rows = rows = smallest_holding(SIZES, n)
            static[rows][:n] = logits
            static[rows][n:] = torch.randn(rows - n, llm.shape.vocab_size) * 30
            return static[rows][:n]

        runner.launch = static_launch
        runner.sampler_graphs = SamplerGraphs.eager(static)
    return llm


def run(llm: Engine, prompts, **params) -> list[list[int]]:
    outs = llm.generate([PromptRequest(i, None, p, {"max_tokens": 12, "ignore_eos": True, **params})
                         for i, p in enumerate(prompts)])
    assert [o.error for o in outs] == [None] * len(prompts)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 1.0, "seed": 1234},
                                    {"temperature": 1.3, "top_p": 1.0}, {"temperature": 0.6, "top_p": 1.0, "top_k": 20},
                                    {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "seed": 3}])
def test_engine_samples_uniform_decode_steps_from_the_graphs_with_the_same_tokens(checkpoint, params):
    plain = make_llm(checkpoint, emulate_graphs=False)
    graphed = make_llm(checkpoint, emulate_graphs=True)
    for prompts in (PROMPTS, PROMPTS[:3], PROMPTS[1:2]):
        assert run(graphed, prompts, **params) == run(plain, prompts, **params)
        assert graphed.last_run["sampler_graph_steps"] > 0 and plain.last_run["sampler_graph_steps"] == 0
    assert graphed.runner.sampler_graphs.num_replays > 0


@pytest.mark.parametrize("params", [{"temperature": 0.8, "top_p": 0.9}, {"temperature": 0.8, "top_p": 1.0, "top_k": 40},
                                    {"temperature": 0.8, "top_p": 1.0, "logprobs": 2},
                                    {"temperature": 0.8, "top_p": 1.0, "min_p": 0.05},
                                    {"temperature": 0.0, "repetition_penalty": 1.2}])
def test_engine_samples_other_steps_eagerly(checkpoint, params):
    plain = make_llm(checkpoint, emulate_graphs=False)
    graphed = make_llm(checkpoint, emulate_graphs=True)
    assert run(graphed, PROMPTS, seed=5, **params) == run(plain, PROMPTS, seed=5, **params)
    assert graphed.runner.sampler_graphs.num_replays == 0 and graphed.last_run["sampler_graph_steps"] == 0
