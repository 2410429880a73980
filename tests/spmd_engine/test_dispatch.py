"""The replicas' request hand-out through a store (torch's HashStore here, the TCPStore in a job): every
request goes to exactly one replica, claims end once the chunks are gone, and every posted row reaches
rank 0's writer before `all_done`."""
from __future__ import annotations

import threading
import time

import torch.distributed as dist

from spmd_engine.core.requests import PromptRequest, RequestOutput
from spmd_engine.job.dispatch import ChunkBoard, ClaimedRequests, Dispatcher, RowPoster
from spmd_engine.job.feed import chunk_size, chunked


def test_chunks_go_to_one_replica_each_and_every_row_comes_back():
    board = ChunkBoard(dist.HashStore(), "job")
    requests = [PromptRequest(i, None, [1, 2, i]) for i in range(23)]
    written: list[dict] = []
    dispatcher = Dispatcher(board, chunked(requests, 3), num_replicas=3, write_row=written.append)
    dispatcher.start()
    claimed: dict[int, list[int]] = {}

    def replica(index: int) -> None:
        feed, poster = ClaimedRequests(board, 3, dispatcher.check), RowPoster(board, index)
        claimed[index] = []
        for request in feed:
            claimed[index].append(request.index)
            if index:
                poster(RequestOutput(request.index, None, request.prompt_token_ids, None, [7], "length", None))
        if index:
            board.post_done(index, poster.posted, poster.stats, 0.0)

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for _ in range(1000):  # at most ~10 s
        if dispatcher.all_done():
            break
        time.sleep(0.01)
    dispatcher.stop()
    dispatcher.check()
    assert sorted(i for ids in claimed.values() for i in ids) == list(range(23))
    assert sorted(row["index"] for row in written) == sorted(claimed[1] + claimed[2])
    assert {r: dispatcher.reports[r]["rows"] for r in (1, 2)} == {1: len(claimed[1]), 2: len(claimed[2])}
    assert board.claim() is None  # a late claim after the end gets nothing, at once


def test_chunks_are_small_enough_to_balance_and_never_outgrow_a_batch():
    assert chunk_size(1_000_000, 1, 256) == 64  # one replica: the reading granularity
    assert chunk_size(15, 2, 256) == 1
    assert chunk_size(10_000, 4, 256) == 64
    assert chunk_size(10_000, 4, 8) == 8
    assert chunk_size(1_000, 4, 256) == 32


def test_a_chunk_published_late_does_not_stall_the_running_sequences(tmp_path):
    """Rank 0 publishes chunk 1 only once chunk 0's requests are finished (or after 10 s): the replica
    that claimed chunk 1 must keep stepping chunk 0's sequences meanwhile, not wait in its claim (the
    old blocking claim waited the whole 10 s, then ran everything), and the tokens stay the greedy ones."""
    from tests.helpers.tiny_checkpoints import make_tiny_checkpoint
    from tests.spmd_engine.test_engine import generate, make_llm

    path = make_tiny_checkpoint(tmp_path / "ckpt", arch="qwen3", max_position_embeddings=128, tokenizer=False)
    prompts = [[5, 6, 7], [9] * 10 + [11], list(range(20, 45)), [40, 41, 42, 43]]
    llm = make_llm(path, max_num_seqs=4, sampling={"temperature": 0.0, "max_tokens": 12, "ignore_eos": True})
    try:
        reference = [o.token_ids for o in generate(llm, prompts)]
        requests = [PromptRequest(i, None, p) for i, p in enumerate(prompts)]
        first_done = threading.Event()
        finished: list[int] = []
        seen_at_publish: list[list[int]] = []

        def late_chunks():
            yield requests[:2]
            first_done.wait(timeout=10.0)
            seen_at_publish.append(sorted(finished))
            yield requests[2:]

        def on_finish(out: RequestOutput) -> None:
            finished.append(out.index)
            if {0, 1} <= set(finished):
                first_done.set()

        board = ChunkBoard(dist.HashStore(), "job")
        dispatcher = Dispatcher(board, late_chunks(), num_replicas=1, write_row=lambda row: None)
        dispatcher.start()
        claimed = ClaimedRequests(board, 1, dispatcher.check)
        try:
            outputs = llm.generate(claimed, on_finish=on_finish)
        finally:
            dispatcher.stop()
        dispatcher.check()
    finally:
        llm.close()
    assert seen_at_publish == [[0, 1]], seen_at_publish  # chunk 0 ran to its end while chunk 1 was pending
    assert claimed.pending_polls > 0 and claimed.claimed == len(prompts)
    assert [o.index for o in outputs] == list(range(len(prompts)))
    assert [o.token_ids for o in outputs] == reference
