"""One `LLM.generate` / `LLM.chat` call over the job's data-parallel replicas: rank 0 hands the call's
requests out as the replicas ask, the way the Hydra job does (spmd_engine/replica_dispatch.py), and
every rank gets every output back in submission order.

Why: inside a torchrun job every replica should work, and a replica that drew long requests should
take fewer. A request is one unit of the hand-out, so all its completions run on one replica.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TypeVar

from spmd_engine.core.requests import PromptRequest, RequestOutput
from spmd_engine.distributed import broadcast_object, default_store
from spmd_engine.engine import Engine
from spmd_engine.replica_dispatch import (ChunkBoard, ClaimedRequests, Dispatcher, OutputPoster, chunk_size, chunked,
                                          wait_until)

Stream = Callable[..., list[RequestOutput]]  # LLM.stream
Result = TypeVar("Result")


def generate_on_replicas(stream: Stream, engine: Engine, requests: list[PromptRequest], use_tqdm: bool,
                         convert: Callable[[list[RequestOutput]], Result]) -> tuple[Result, list[int]]:
    """Run rank 0's `requests` over every replica; collective over every rank. Every rank returns
    `convert` (run on rank 0) of every request's output in submission order, and how many requests
    each replica ran (index: replica)."""
    replica, first = engine.replica, engine.ranks.is_first
    if replica.count == 1:
        outputs = stream(requests if first else [], progress=use_tqdm)
        return broadcast_object((convert(outputs), [len(outputs)]) if first else None)
    board = ChunkBoard(default_store(), broadcast_object(f"spmd_engine/api/{uuid.uuid4().hex}" if first else None))
    outputs, counts = _lead(stream, engine, board, requests, use_tqdm) if first else _serve(stream, engine, board)
    result = broadcast_object((convert(outputs), counts) if first else None)
    if first:
        board.forget(replica.count)  # every rank is past `finished`: the call's keys go
    return result


def _lead(stream: Stream, engine: Engine, board: ChunkBoard, requests: list[PromptRequest],
          use_tqdm: bool) -> tuple[list[RequestOutput], list[int]]:
    """Rank 0: publish the chunks, run replica 0's claims, gather the other replicas' outputs."""
    count = engine.replica.count
    posted: list[RequestOutput] = []
    size = chunk_size(len(requests), count, engine.cfg.max_num_seqs)
    dispatcher = Dispatcher(board, chunked(requests, size), count, posted.append)
    dispatcher.start()
    try:
        own = stream(ClaimedRequests(board, count, dispatcher.check), progress=use_tqdm)
        wait_until(dispatcher.all_done, engine.step_progress, dispatcher.check)
    finally:
        dispatcher.stop()
    dispatcher.check()
    board.finish()
    counts = [len(own)] + [dispatcher.reports[r]["rows"] for r in range(1, count)]
    return sorted([*own, *posted], key=lambda out: out.order), counts


def _serve(stream: Stream, engine: Engine, board: ChunkBoard) -> tuple[list[RequestOutput], list[int]]:
    """Every other rank: a replica's leader claims chunks and posts each output to rank 0; the others
    follow their leader's plans. Then wait (polling, not in a collective) until rank 0 has them all."""
    replica = engine.replica
    if replica.is_leader:
        poster = OutputPoster(board, replica.index, form=_as_is)
        stream(ClaimedRequests(board, replica.count), on_finish=poster, keep_outputs=False)
        board.post_done(replica.index, poster.posted)
    else:
        stream([])
    wait_until(board.is_finished, engine.step_progress)
    return [], []


def _as_is(out: RequestOutput) -> RequestOutput:
    return out  # the output itself, all its fields (an outputs.jsonl row caps an error's prompt)
