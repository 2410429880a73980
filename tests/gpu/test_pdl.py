"""Programmatic Dependent Launch (kernels/pdl.py, engine key `cuda_pdl`) on the GPU: with PDL on, every Triton
kernel of a decode / mixed step and of the sampler gives the bits it gives with PDL off, launched eagerly and
replayed from a CUDA graph, and a tiny model's greedy tokens, logprobs and seeded top-p draws are the same."""
from __future__ import annotations

import pytest
import torch

from spmd_engine.kernels import pdl
from tests.gpu.engine_setup import GPU, PROMPTS, make_llm, tiny_bf16_checkpoint
from tests.helpers.decode_step import DecodeStep
from tests.helpers.graph_capture import capture
from tests.helpers.split_oracles import second_launch_reductions

HOPPER = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                            reason="PDL needs compute capability 9.0+")
pytestmark = [*GPU, HOPPER]


@pytest.fixture(autouse=True)
def pdl_off_afterwards():
    yield
    pdl.set_pdl(False)


def run_both_ways(fn) -> dict[str, list[torch.Tensor]]:
    """fn's outputs (a list of tensors) with PDL off and on, eager and replayed from a graph captured under
    that setting (warm-up on a side stream first, as the engine captures)."""
    results = {}
    for on in (False, True):
        pdl.set_pdl(on)
        results[f"eager {on}"] = [t.clone() for t in fn()]
        graph, outs = capture(fn)
        for t in outs:
            t.zero_()  # the replay must write them
        graph.replay()
        torch.cuda.synchronize()
        results[f"graph {on}"] = [t.clone() for t in outs]
        del graph
    pdl.set_pdl(False)
    return results


def assert_all_equal(results: dict[str, list[torch.Tensor]]) -> None:
    (first, expected), *rest = results.items()
    for name, outs in rest:
        for i, (a, b) in enumerate(zip(outs, expected)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name} output {i} differs from {first}"


def test_pdl_runs_on_this_gpu():
    """The switch turns PDL on here (Triton has the grid-dependency ops and the launch option)."""
    pdl.set_pdl(True)
    assert pdl.pdl_supported("cuda") and pdl.pdl_enabled(torch.device("cuda", torch.cuda.current_device()))


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("one_launch", [True, False])  # splits reduced in the split kernels, or by second launches
def test_decode_step_kernels_same_bits(batch, one_launch):
    """The benches' Qwen3-0.6B-shaped decode step (tests/helpers/decode_step.py): RMSNorm, GEMV, q/k norm +
    rotary + KV store, split-KV decode attention, the LM head; at 64 rows cuBLAS matmuls and silu_and_mul in
    between. `one_launch` False: the split-K sums and split merges by the oracle's second launches
    (tests/helpers/split_oracles.py), chained to the split kernels by PDL, and the same bits as the engine's
    one-launch step."""
    # 4 layers: every kernel of a layer (28 would only take longer); 3 splits of the decode attention at batch 1
    step = DecodeStep(batch, context=300, layers=4)

    def run():
        step.run()
        return [step.logits]

    with torch.inference_mode():
        if one_launch:
            assert_all_equal(run_both_ways(run))
            return
        engine_bits = [t.clone() for t in run()]
        with second_launch_reductions() as second:
            results = run_both_ways(run)
        assert "_decode_split_kernel" in second.names and ("_gemv_kernel" in second.names) == (batch == 1)
        assert_all_equal({"one launch, PDL off": engine_bits, **results})


@pytest.mark.parametrize("fuse", [True, False])
def test_mixed_step_attention_same_bits(fuse):
    """The attention plan of a mixed step (decode rows + prompt chunks): one launch, or (a decode tile whose
    num_warps differ from the prefill tile's) the decode and prefill kernels back to back; and the store of
    the step's keys before it."""
    import dataclasses

    from spmd_engine.kernels.decode_attention import default_decode_config
    from spmd_engine.kernels.kv_store import store_kv
    from spmd_engine.kernels.mixed_attention import plan_paged_attention
    from spmd_engine.kernels.prefill_attention import default_prefill_config
    from tests.kernels.paged_batch import make_paged_batch

    num_decode = 4
    batch = make_paged_batch([1] * num_decode + [200, 57], [900, 1300, 77, 2000, 200, 400], 16, 16, 8, 128,
                             torch.bfloat16, seed=3)
    k_new = torch.randn(batch.query.shape[0], 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(batch.k_cache.shape[0] * 16, device="cuda")[:batch.query.shape[0]]
    cuda = torch.device("cuda")
    config = default_decode_config(128, cuda)
    if not fuse:
        config = dataclasses.replace(config, num_warps=2 * default_prefill_config(128, cuda).num_warps)

    def run():
        store_kv(k_new, k_new, batch.k_cache, batch.v_cache, slots)
        out = torch.empty_like(batch.query)
        plan = plan_paged_attention(batch.query, batch.k_cache, batch.v_cache, out, batch.cu_seqlens_q,
                                    batch.seq_lens, batch.block_tables, num_decode, batch.max_query_len,
                                    decode_config=config, share_partials=False)
        assert (plan.mixed is not None) == fuse
        return [plan.launch(batch.query, batch.k_cache, batch.v_cache, out, batch.scale)]

    assert_all_equal(run_both_ways(run))


def test_sampling_kernels_same_bits():
    from spmd_engine.kernels.sampling_noise import gumbel_noise, gumbel_noise_at, gumbel_race, nucleus_sample

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 8, 151936
    logits = torch.randn(rows, vocab, device="cuda", generator=gen) * 3
    temps = torch.full((rows,), 0.7, device="cuda")
    top_ps = torch.full((rows,), 0.9, device="cuda")
    seeds = torch.arange(rows, device="cuda", dtype=torch.int64) * 7919
    counters = torch.arange(rows, device="cuda", dtype=torch.int64)
    cols = torch.randint(0, vocab, (rows, 20), device="cuda", generator=gen)

    def run():
        return [gumbel_race(logits, temps, seeds, counters), nucleus_sample(logits, temps, top_ps, seeds, counters, 4),
                gumbel_noise(seeds, counters, 1, 4096), gumbel_noise_at(seeds, counters, 2, cols)]

    assert_all_equal(run_both_ways(run))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_bf16_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def engine_results(checkpoint, **engine) -> list:
    from spmd_engine.job.prompts import PromptRequest

    llm = make_llm(checkpoint, **engine)
    try:
        assert llm.runner.pdl is engine["cuda_pdl"]
        requests = [PromptRequest(i, None, p, {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True,
                                               "logprobs": 5, "prompt_logprobs": 2})
                    for i, p in enumerate(PROMPTS)]
        requests += [PromptRequest(len(PROMPTS) + i, None, p, {"temperature": 0.8, "top_p": 0.9, "seed": 11 + i,
                                                               "max_tokens": 16, "ignore_eos": True})
                     for i, p in enumerate(PROMPTS[:3])]
        outs = llm.generate(requests)
        assert [o.error for o in outs] == [None] * len(requests)
        return [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in outs]
    finally:
        llm.close()


def test_tiny_model_same_tokens_and_logprobs(checkpoint):
    """Greedy tokens with their top-5 logprobs (float32 logits, compared exactly), prompt logprobs (the
    prefill path) and seeded top-p draws: the same with cuda_pdl on (the small decode graphs) as off."""
    off = engine_results(checkpoint, cuda_pdl=False)
    on = engine_results(checkpoint, cuda_pdl=True)
    assert on == off


def test_only_the_small_decode_graphs_launch_with_pdl(checkpoint, monkeypatch):
    """PDL is asked for per captured decode graph (at most PDL_MAX_ROWS rows: it costs a little at 256)
    and is off again for every other launch (eager, piecewise, sampling) once the engine has started."""
    from spmd_engine.executor.cuda_graphs import PDL_MAX_ROWS, graph_batch_sizes
    from spmd_engine.kernels import pdl

    asked = []
    real = pdl.pdl_launches

    def recording(enabled):
        asked.append(enabled)
        return real(enabled)

    monkeypatch.setattr(pdl, "pdl_launches", recording)
    llm = make_llm(checkpoint, cuda_pdl=True, max_num_seqs=160)
    try:
        sizes = sorted(llm.runner.graphs.sizes, reverse=True)
        assert sizes == sorted(graph_batch_sizes(160), reverse=True) and max(sizes) > PDL_MAX_ROWS
        assert asked == [n <= PDL_MAX_ROWS for n in sizes]
        assert not pdl.pdl_enabled("cuda")
    finally:
        llm.close()
