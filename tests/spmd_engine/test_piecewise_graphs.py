"""Piecewise graphs on CPU: `RerunCapture` replays a piece by running it again over the same static
buffers, so these tests check what the CUDA graphs rely on (every piece reads and writes only static
buffers, padding rows store nothing, attention between the pieces sees the real batch)."""
import numpy as np
import pytest
import torch
from spmd_engine.models.loader import load_dummy_weights
from spmd_engine.models.model_config import ModelShape
from spmd_engine.models.parallel import TensorParallel
from spmd_engine.models.registry import build_model

from spmd_engine.core.plan import StepPlan
from spmd_engine.executor.forward_batch import to_device
from spmd_engine.executor.input_buffers import InputBuffers
from spmd_engine.executor.model_runner import ModelRunner, RunnerSettings
from spmd_engine.executor.piecewise_graphs import (
    PiecewiseGraphs,
    RerunCapture,
    piecewise_token_buckets,
)

HF = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 97,
      "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
      "eos_token_id": 1}
BLOCK, MAX_LEN, NUM_BLOCKS = 4, 32, 40
BUCKETS = [8, 16, 32]


def test_buckets_are_capped_by_and_include_the_token_budget():
    assert piecewise_token_buckets(8192)[:9] == [16, 32, 64, 128, 256, 512, 768, 1024, 1280]
    assert piecewise_token_buckets(8192)[-3:] == [6144, 7168, 8192]
    assert piecewise_token_buckets(1000) == [16, 32, 64, 128, 256, 512, 768, 1000]
    assert piecewise_token_buckets(10) == [10]
    assert piecewise_token_buckets(32768)[-9:] == [8192, 10240, 12288, 14336, 16384, 20480, 24576, 28672, 32768]
    assert len(piecewise_token_buckets(32768)) == 28
    with pytest.raises(ValueError, match="max_tokens"):
        piecewise_token_buckets(0)


@pytest.fixture(params=["torch", "triton"])
def runner(request):
    """The triton backend (TRITON_INTERPRET on CPU) also runs the decode / prefill kernel split."""
    torch.manual_seed(0)
    model = build_model(HF, TensorParallel.single(), request.param)
    load_dummy_weights(model, 0)
    settings = RunnerSettings(BLOCK, MAX_LEN, 8, 32, False, 0.9, 1.0, num_kv_blocks=NUM_BLOCKS)
    runner = ModelRunner(model, ModelShape.from_hf_config(HF), settings, torch.device("cpu"), torch.float32, 1)
    for k, v in runner.kv_caches:  # allocated uninitialised: NaN garbage would defeat the comparisons
        k.zero_(), v.zero_()
    runner.inputs = InputBuffers(32, 8, MAX_LEN // BLOCK, BLOCK, runner.device)
    runner.piecewise = PiecewiseGraphs.capture(model, runner.inputs, 8, BUCKETS, RerunCapture())
    return runner


def plan(step: int, seqs: list[tuple[int, int, int, bool]], blocks: dict[int, list[int]], rng) -> StepPlan:
    """seqs: (seq id, tokens already cached, tokens now, sample); blocks: new blocks per seq id."""
    ids = [s[0] for s in seqs]
    new = [blocks.get(i, []) for i in ids]
    return StepPlan(step=step, seq_ids=np.array(ids), num_computed=np.array([s[1] for s in seqs], dtype=np.int32),
                    query_lens=np.array([s[2] for s in seqs], dtype=np.int32),
                    input_ids=rng.integers(2, 97, sum(s[2] for s in seqs)).astype(np.int32),
                    sample=np.array([s[3] for s in seqs]), reset_tables=np.array([s[1] == 0 for s in seqs]),
                    new_block_counts=np.array([len(b) for b in new], dtype=np.int32),
                    new_block_ids=np.array([b for blocks in new for b in blocks], dtype=np.int32))


def steps():
    rng = np.random.default_rng(0)
    return [
        # three prompts (17 tokens: bucket 32)
        plan(0, [(0, 0, 5, True), (1, 0, 9, True), (2, 0, 3, True)], {0: [3, 17], 1: [8, 1, 30], 2: [22]}, rng),
        # mixed, decodes behind a prompt chunk in plan order (9 tokens: bucket 16)
        plan(1, [(0, 5, 1, True), (3, 0, 6, False), (1, 9, 1, True), (2, 3, 1, True)],
             {3: [5, 11], 1: [], 2: [9]}, rng),
        # the chunk's end and three decodes (7 tokens: bucket 8)
        plan(2, [(3, 6, 4, True), (0, 6, 1, True), (1, 10, 1, True), (2, 4, 1, True)], {3: [12]}, rng),
        # exactly a bucket: four decodes and a 4-token prompt (8 tokens)
        plan(3, [(0, 7, 1, True), (1, 11, 1, True), (4, 0, 4, True), (2, 5, 1, True), (3, 10, 1, True)],
             {4: [33], 1: [2]}, rng),
    ]


def test_piecewise_replay_equals_the_eager_forward(runner):
    assert runner.piecewise.sizes == BUCKETS
    for p in steps():
        staged = runner.stage(p)
        assert staged.piecewise_tokens == min(n for n in BUCKETS if n >= p.num_tokens)
        before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        with torch.inference_mode():
            piecewise = runner.launch(staged).clone()
            piecewise_cache = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
            for (k, v), (k0, v0) in zip(runner.kv_caches, before):
                k.copy_(k0), v.copy_(v0)
            batch = to_device(staged.host, BLOCK, runner.device)
            hidden = runner.model(batch.input_ids, batch.positions, batch.attn)
            eager = runner.model.compute_logits(hidden.index_select(0, batch.logits_indices))
        assert piecewise.shape == eager.shape == (int(p.sample.sum()), 97)
        torch.testing.assert_close(piecewise, eager, rtol=1e-5, atol=1e-5)
        assert piecewise.argmax(-1).tolist() == eager.argmax(-1).tolist()
        for (k, v), (kp, vp) in zip(runner.kv_caches, piecewise_cache):  # padding rows stored nothing
            torch.testing.assert_close(kp, k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(vp, v, rtol=1e-5, atol=1e-5)
    assert runner.piecewise.num_replays == len(steps())


def test_steps_beyond_the_largest_bucket_or_with_prompt_logprobs_run_eagerly(runner):
    rng = np.random.default_rng(1)
    big = plan(0, [(0, 0, 30, True), (1, 0, 3, True)], {0: list(range(8)), 1: [9]}, rng)
    assert runner.stage(big).piecewise_tokens is None  # 33 tokens > 32
    logprobs = plan(0, [(2, 0, 5, True)], {2: [10, 11]}, rng)
    logprobs.prompt_logits = np.array([4], dtype=np.int32)
    assert runner.stage(logprobs).piecewise_tokens is None


def test_prompt_logprob_rows_follow_the_decode_first_reorder(runner):
    """A prompt with prompt logprobs ahead of a decode in plan order: the batch puts the decode first,
    yet the prompt rows' logits (and the sampled rows' order) equal those of the plan in batch order."""
    rng = np.random.default_rng(2)
    runner.execute(plan(0, [(0, 0, 5, True)], {0: [3, 17]}, rng))
    results = []
    for order in ([(7, 0, 6, True), (0, 5, 1, True)], [(0, 5, 1, True), (7, 0, 6, True)]):
        step = plan(1, order, {7: [8, 9]}, np.random.default_rng(3))
        if order[0][0] == 0:  # the same inputs in the other order
            step.input_ids = np.roll(step.input_ids, 1)
        step.prompt_logits = np.array([5 if s[0] == 7 else 0 for s in order], dtype=np.int32)
        staged = runner.stage(step)
        assert staged.piecewise_tokens is None and (staged.host.token_rows is None) == (order[0][0] == 0)
        with torch.inference_mode():
            sampled = runner.launch(staged).clone()
        results.append((sampled, runner.last_prompt_logits.clone()))
    (sampled_a, prompt_a), (sampled_b, prompt_b) = results
    torch.testing.assert_close(prompt_a, prompt_b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sampled_a, sampled_b.flip(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_an_engine_with_piecewise_graphs_generates_the_eager_tokens(tmp_path, async_scheduling):
    """The whole loop: chunked prompts make mixed steps (replayed by pieces, their deferred inputs
    written into the static input buffers); greedy tokens equal the eager engine's, and metrics count
    the mixed steps by launch."""
    from spmd_engine.config import engine_config_from_dict
    from spmd_engine.distributed import RankInfo
    from spmd_engine.engine import Engine
    from spmd_engine.job.prompts import PromptRequest
    from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "ckpt", max_position_embeddings=128, tokenizer=False)
    prompts = [[5, 6, 7], list(range(40, 65)), [9] * 10 + [11], list(range(100, 131))]

    def run(piecewise: bool) -> tuple[list[list[int]], dict]:
        raw = {"model": {"name": "tiny", "path": str(path), "load_format": "auto", "hf_config": {}},
               "workload": {"name": "chat"}, "sampling": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True},
               "device": "cpu", "dtype": "float32", "num_kv_blocks": 64, "block_size": 4, "max_num_seqs": 4,
               "max_num_batched_tokens": 16, "async_scheduling": async_scheduling}
        llm = Engine(engine_config_from_dict(raw), RankInfo(0, 1, 0, "127.0.0.1", 0, "single"))
        try:
            runner = llm.runner
            if piecewise:
                runner.inputs = InputBuffers(16, 4, runner.mirror.max_blocks, 4, runner.device)
                runner.piecewise = PiecewiseGraphs.capture(runner.model, runner.inputs, 4,
                                                           piecewise_token_buckets(16), RerunCapture())
            outs = llm.generate([PromptRequest(i, None, p) for i, p in enumerate(prompts)])
            return [o.token_ids for o in outs], llm.last_run["step_timing"]
        finally:
            llm.close()

    eager, eager_timing = run(piecewise=False)
    graphed, timing = run(piecewise=True)
    assert graphed == eager
    assert "piecewise_graph" not in eager_timing["mixed"]["launches"]
    assert timing["mixed"]["launches"]["piecewise_graph"] == timing["mixed"]["steps"] > 0
    # no decode graphs here: the pure decode steps replay the pieces too
    assert timing["decode"]["launches"] == {"piecewise_graph": timing["decode"]["steps"]}
