"""The step's small copies on their own streams: each still comes after the readers queued before it
and before the readers that need it, while it no longer waits behind the forward in flight.

A long `torch.cuda._sleep` on the compute stream stands for the forward in flight.
"""
import time

import numpy as np
import pytest
import torch

from spmd_engine.executor.forward_batch import HostBatch
from spmd_engine.executor.input_buffers import InputBuffers
from spmd_engine.executor.sampler import _KeyStaging
from spmd_engine.executor.token_readback import ReadbackBuffers, TokenReadback
from tests.gpu.engine_setup import GPU, PROMPTS, greedy_tokens, make_llm, tiny_bf16_checkpoint

pytestmark = GPU

SLEEP_CYCLES = 200_000_000  # ~0.1 s at the H200's clock: far longer than any copy below


def _decode_batch(ids: list[int], max_blocks: int) -> HostBatch:
    host = HostBatch.padding(len(ids), max_blocks)
    host.input_ids[:] = ids
    return host


def test_input_copy_comes_after_earlier_readers_and_before_the_forward():
    buffers = InputBuffers(max_tokens=64, max_seqs=8, max_blocks=4, block_size=16, device=torch.device("cuda"))
    first = buffers.load(_decode_batch([1, 2, 3, 4], 4), rows=4)
    torch.cuda._sleep(SLEEP_CYCLES)  # the forward in flight, which reads the buffers...
    seen_by_forward = first.input_ids.clone()  # ...until its end
    second = buffers.load(_decode_batch([5, 6, 7, 8], 4), rows=4, wait=False)
    buffers.wait_copied()  # what the runner does before the next forward
    seen_by_next = second.input_ids.clone()
    assert seen_by_forward.tolist() == [1, 2, 3, 4]  # the copy waited for the reader queued before it
    assert seen_by_next.tolist() == [5, 6, 7, 8]


def test_key_copy_waits_for_the_last_key_reader_only():
    device = torch.device("cuda")
    staging, static = _KeyStaging(device), torch.zeros(12, dtype=torch.int64, device=device)
    keys_read = torch.cuda.Event()
    seen_before = static.clone()  # the last sampling that read the keys
    keys_read.record()
    torch.cuda._sleep(SLEEP_CYCLES)  # the forward in flight
    staging.put(np.arange(12, dtype=np.int64), into=static, after=keys_read)
    seen_after = static.clone()  # the sampling, after the forward
    deadline = time.monotonic() + 0.05
    while not staging._copied.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    copied_during_forward = staging._copied.query()
    torch.cuda.synchronize()
    assert copied_during_forward  # it did not queue behind the sleep
    assert seen_before.tolist() == [0] * 12
    assert seen_after.tolist() == list(range(12))


def test_token_readback_takes_the_sampled_tokens_while_the_next_forward_runs():
    pool = ReadbackBuffers()
    tokens = torch.zeros(4, dtype=torch.int64, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES // 4)  # the sampling takes a while...
    tokens.copy_(torch.tensor([9, 8, 7, 6], device="cuda"))  # ...and writes the tokens at its end
    readback = TokenReadback(tokens, pool)
    torch.cuda._sleep(SLEEP_CYCLES)  # the next forward, queued behind the readback
    host = readback.numpy()
    assert host.tolist() == [9, 8, 7, 6]
    assert not torch.cuda.current_stream().query()  # the host got its tokens while the forward still ran


def test_fence_orders_an_overwrite_after_an_unread_copy():
    pool = ReadbackBuffers()
    tokens = torch.tensor([1, 2, 3], device="cuda")
    with torch.cuda.stream(pool.copy_stream(tokens.device)):
        torch.cuda._sleep(SLEEP_CYCLES // 4)  # the copy stream is late
    readback = TokenReadback(tokens, pool)
    pool.fence()  # a sampler graph replay is about to overwrite its static tokens
    tokens.fill_(0)
    assert readback.numpy().tolist() == [1, 2, 3]  # without the fence the fill would win
    assert pool._unread == []


def test_eager_sampler_keys_travel_beside_the_forward_and_draw_the_same_tokens():
    from spmd_engine.executor.sampler import Sampler, SamplingBatch

    rows, vocab = 6, 5000
    logits = torch.randn(rows, vocab, device="cuda")
    batch = SamplingBatch(np.arange(rows, dtype=np.int64) + 3, np.arange(rows, dtype=np.int64),
                          np.full(rows, 0.7), np.array([0.9, 0.95, 1.0, 0.5, 0.9, 1.0]), np.zeros(rows, np.int64))
    expected = Sampler(torch.device("cuda")).sample_on_device(logits, batch).tolist()  # first draw: no event yet
    sampler = Sampler(torch.device("cuda"))
    sampler.sample_on_device(logits, batch)  # makes its device key buffer
    torch.cuda._sleep(SLEEP_CYCLES)  # the forward in flight
    tokens = sampler.sample_on_device(logits, batch)
    deadline = time.monotonic() + 0.05
    while not sampler._staging._copied.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    copied_during_forward = sampler._staging._copied.query()
    assert tokens.tolist() == expected
    assert copied_during_forward


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_bf16_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def test_graphs_match_eager_under_preemption_and_chunked_prefill(checkpoint):
    """The copies' orderings under pressure: async scheduling, 32-token chunks and a 10-block pool that
    preempts; the decode graphs (staged inputs, sampler keys and readbacks on their streams) give the eager
    engine's greedy tokens, twice over."""
    prompts = PROMPTS + [list(range(200, 260)), [7] * 45]
    pressure = dict(num_kv_blocks=10, block_size=16, max_model_len=128, max_num_batched_tokens=32,
                    attention_backend="triton", async_scheduling=True)
    eager = make_llm(checkpoint, enforce_eager=True, **pressure)
    try:
        expected = greedy_tokens(eager, prompts, 24)
        assert eager.last_run["preemptions"] > 0
    finally:
        eager.close()
    llm = make_llm(checkpoint, **pressure)
    try:
        assert llm.runner.graphs is not None
        for _ in range(2):
            assert greedy_tokens(llm, prompts, 24) == expected
            assert llm.last_run["preemptions"] > 0
        assert llm.runner.graphs.num_replays > 0
    finally:
        llm.close()
