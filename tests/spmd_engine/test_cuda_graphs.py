"""What the decode graphs record, checked eagerly on CPU: padding rows change nothing real."""
import bisect

import numpy as np
import pytest
import torch

from spmd_engine.models.loader import load_dummy_weights
from spmd_engine.models.model_config import ModelShape
from spmd_engine.models.parallel import TensorParallel
from spmd_engine.models.registry import build_model
from spmd_engine.executor.cuda_graphs import decode_step, graph_batch_sizes
from spmd_engine.executor.forward_batch import build_host_batch, to_device
from spmd_engine.executor.input_buffers import InputBuffers
from spmd_engine.executor.model_runner import ModelRunner, RunnerSettings
from spmd_engine.core.plan import StepPlan

HF = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 97,
      "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
      "eos_token_id": 1}
BLOCK = 4


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 40, 256, 300])
def test_every_decode_batch_up_to_max_num_seqs_has_a_graph_with_little_padding(max_num_seqs):
    """Each batch runs in the smallest graph that holds it: at most 2x its rows and fewer than 16
    padding rows, never past max_num_seqs; and the number of graphs (capture time, memory) stays small."""
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs
    for n in range(1, max_num_seqs + 1):
        padded = sizes[bisect.bisect_left(sizes, n)]
        assert n <= padded <= 2 * n and padded - n < 16, (n, padded)
    assert len(sizes) <= 5 + max_num_seqs // 16
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_sizes(0)


@pytest.fixture
def runner():
    torch.manual_seed(0)
    model = build_model(HF, TensorParallel.single(), "torch")
    load_dummy_weights(model, 0)
    settings = RunnerSettings(BLOCK, 32, 8, 64, False, 0.9, 1.0, num_kv_blocks=40)
    return ModelRunner(model, ModelShape.from_hf_config(HF), settings, torch.device("cpu"), torch.float32, 1)


def three_sequence_plans(seed: int) -> tuple[StepPlan, StepPlan]:
    """A prefill of three sequences (5, 9 and 3 random tokens over scattered blocks), then one decode step."""
    lens = [5, 9, 3]
    blocks = [[3, 17], [8, 1, 30], [22]]
    prefill = StepPlan(step=0, seq_ids=np.arange(3), num_computed=np.zeros(3, dtype=np.int32),
                       query_lens=np.array(lens, dtype=np.int32),
                       input_ids=np.random.default_rng(seed).integers(0, 97, sum(lens)).astype(np.int32),
                       sample=np.ones(3, dtype=bool), reset_tables=np.ones(3, dtype=bool),
                       new_block_counts=np.array([len(b) for b in blocks], dtype=np.int32),
                       new_block_ids=np.array(sum(blocks, []), dtype=np.int32))
    decode = StepPlan(step=1, seq_ids=np.arange(3), num_computed=np.array(lens, dtype=np.int32),
                      query_lens=np.ones(3, dtype=np.int32), input_ids=np.array([5, 6, 7], dtype=np.int32),
                      sample=np.ones(3, dtype=bool), reset_tables=np.zeros(3, dtype=bool),
                      new_block_counts=np.zeros(3, dtype=np.int32), new_block_ids=np.zeros(0, dtype=np.int32))
    return prefill, decode


def test_padded_decode_gives_the_same_logits_and_kv(runner):
    prefill, decode = three_sequence_plans(seed=0)
    for k, v in runner.kv_caches:  # allocated uninitialised: NaN garbage would defeat torch.equal
        k.zero_(), v.zero_()
    runner.execute(prefill)
    host = build_host_batch(decode, runner.mirror.apply(decode), BLOCK)
    with torch.inference_mode():
        eager = decode_step(runner.model, to_device(host, BLOCK, runner.device), runner.feed)
        cache_after_eager = [k.clone() for k, _ in runner.kv_caches]
        buffers = InputBuffers(8, 8, host.block_tables.shape[1], BLOCK, runner.device)
        padded = decode_step(runner.model, buffers.load(host, rows=8), runner.feed)
    assert padded.shape == (8, 97)
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    real = torch.zeros(40 * BLOCK, dtype=torch.bool)
    real[torch.from_numpy(host.slot_mapping)] = True
    for (k, _), before in zip(runner.kv_caches, cache_after_eager):
        k, before = k.reshape(40 * BLOCK, -1), before.reshape(40 * BLOCK, -1)
        assert torch.equal(k[~real], before[~real])  # padded rows stored nothing (slot -1)
        torch.testing.assert_close(k[real], before[real])


def test_longest_first_batch_gives_the_plan_order_logits_of_row_order(runner, monkeypatch):
    """The batch runs longest first (`batch_order`), yet logits row j is the plan's j-th sequence, with the
    bits of the batch in plan order: no row's result depends on its place in the batch."""
    import spmd_engine.executor.forward_batch as forward_batch

    prefill, decode = three_sequence_plans(seed=1)
    runner.execute(prefill)
    tables = runner.mirror.apply(decode)
    longest_first = build_host_batch(decode, tables, BLOCK)
    assert longest_first.seq_lens.tolist() == [10, 6, 4] and longest_first.logits_indices.tolist() == [1, 0, 2]
    monkeypatch.setattr(forward_batch, "batch_order", lambda query_lens, seq_lens: None)
    plan_order = build_host_batch(decode, tables, BLOCK)
    assert plan_order.seq_lens.tolist() == [6, 10, 4]
    with torch.inference_mode():
        a = decode_step(runner.model, to_device(longest_first, BLOCK, runner.device), runner.feed)
        b = decode_step(runner.model, to_device(plan_order, BLOCK, runner.device), runner.feed)
    assert torch.equal(a, b)


def test_a_graph_step_takes_its_deferred_inputs_from_the_feed(runner):
    """What a decode graph records first: the rows whose ids the previous step drew read them from the token
    feed (where the sampler graphs draw); the logits are those of the ids known on the host."""
    import dataclasses

    prefill, decode = three_sequence_plans(seed=2)
    runner.execute(prefill)
    host = build_host_batch(decode, runner.mirror.apply(decode), BLOCK)
    known = host.input_ids.copy()
    deferred = dataclasses.replace(host, input_ids=np.where(np.arange(3) == 1, known, 0),
                                   feed_rows=np.array([2, -1, 0]))
    runner.feed[:3] = torch.tensor([known[2], 99, known[0]])
    with torch.inference_mode():
        buffers = InputBuffers(8, 8, host.block_tables.shape[1], BLOCK, runner.device)
        a = decode_step(runner.model, buffers.load(deferred, rows=4), runner.feed)
        assert buffers.device_view("input_ids", 3).tolist() == known.tolist()
        b = decode_step(runner.model, buffers.load(host, rows=4), runner.feed)  # the same K/V stored again
    assert torch.equal(a, b)


def test_no_graphs_and_no_staging_buffers_on_cpu(runner):
    assert runner.graphs is None and runner.inputs is None and not runner.use_graphs


def test_capture_input_is_all_padding_rows():
    """What the graphs are captured on (HostBatch.padding, from BATCH_FIELDS): rows that read and store nothing."""
    from spmd_engine.executor.forward_batch import HostBatch

    buffers = InputBuffers(8, 4, 3, BLOCK, torch.device("cpu"))
    batch = buffers.load(HostBatch.padding(4, 3), rows=4)
    assert batch.input_ids.tolist() == [0] * 4 and batch.attn.slot_mapping.tolist() == [-1] * 4
    assert batch.attn.seq_lens.tolist() == [0] * 4 and batch.attn.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert batch.attn.block_tables.shape == (4, 3) and batch.logits_indices.tolist() == [0, 1, 2, 3]


def test_warmup_prefill_stores_nothing_and_gets_logits_of_each_last_token():
    """The start-up warm-up's batch (HostBatch.unstored_prefill, from BATCH_FIELDS): whole prefills, no slot."""
    from spmd_engine.executor.forward_batch import HostBatch

    host = HostBatch.unstored_prefill([5, 3])
    assert host.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2] and host.slot_mapping.tolist() == [-1] * 8
    assert host.cu_seqlens_q.tolist() == [0, 5, 8] and host.seq_lens.tolist() == [5, 3]
    assert host.logits_indices.tolist() == [4, 7] and (host.max_query_len, host.is_decode) == (5, False)
    assert host.block_tables.shape == (2, 1)
