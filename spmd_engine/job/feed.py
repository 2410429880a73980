"""Rank 0's request feed: requests read, checked and tokenized a chunk at a time, as the replicas need work.

Why: reading and tokenizing a whole prompts file before the first step costs minutes and memory that
grows with the file; a chunk at a time, generation starts at once and rank 0 holds only the requests
handed out and not yet written.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from spmd_engine.config import EngineConfig
from spmd_engine.core.requests import PromptRequest
from spmd_engine.job.outputs import resume_mismatch
from spmd_engine.job.prompts import DEFAULT_PROMPTS, iter_prompts, tokenize
from spmd_engine.job.workloads import bench_requests, default_token_requests
from spmd_engine.replica_dispatch import CHUNK_REQUESTS, chunk_size, chunked

__all__ = ["CHUNK_REQUESTS", "RequestFeed", "chunk_size", "chunked", "source_requests"]


def source_requests(cfg: EngineConfig, has_tokenizer: bool, vocab_size: int) -> tuple[Iterator[PromptRequest], int]:
    """The job's requests in index order, not yet tokenized, and how many there are (`build_requests`'
    requests, lazily: a prompts_file is read as the iterator is pulled)."""
    if cfg.workload.name == "bench":
        requests = bench_requests(cfg.workload.params)
    elif cfg.prompts is None and cfg.prompts_file is None:
        if not has_tokenizer:
            requests = default_token_requests(cfg.seed, vocab_size)
        else:
            return iter_prompts(list(DEFAULT_PROMPTS), None)
    else:
        return iter_prompts(cfg.prompts, cfg.prompts_file)
    return iter(requests), len(requests)


@dataclass
class RequestFeed:
    """The job's requests as chunks to hand out: resumed indices dropped, text tokenized per chunk, each
    request's sampling kept until its row is written (`sampling_of` pops it)."""

    cfg: EngineConfig
    tokenizer: Any
    requests: Iterator[PromptRequest]
    total: int  # requests in the job, finished ones of a resumed job included
    chunk_size: int = CHUNK_REQUESTS
    finished: set[int] = field(default_factory=set)  # resume: indices already in outputs.jsonl
    kinds: dict[int, str | None] = field(default_factory=dict)  # output_format=openai: each index's API
    _sampling: dict[int, dict] = field(default_factory=dict)

    def sampling_for(self, request: PromptRequest) -> dict:
        return {**vars(self.cfg.sampling), **request.overrides}

    def sampling_of(self, index: int) -> dict | None:
        """The sampling of a request handed out, once (for its row)."""
        return self._sampling.pop(index, None)

    def _tokenize(self, requests: list[PromptRequest]) -> list[PromptRequest]:
        return tokenize(requests, self.tokenizer, self.cfg.chat_template, self.cfg.chat_template_kwargs)

    def chunks(self) -> Iterator[list[PromptRequest]]:
        """Chunks of at most chunk_size requests to run, read and tokenized only when asked for."""
        for chunk in chunked(self.requests, self.chunk_size):
            todo = self._tokenize([r for r in chunk if r.index not in self.finished])
            for request in todo:
                self._sampling[request.index] = self.sampling_for(request)
                if self.cfg.output_format == "openai":
                    self.kinds[request.index] = request.api
            if todo:
                yield todo

    def __iter__(self) -> Iterator[PromptRequest]:
        for chunk in self.chunks():
            yield from chunk

    @property
    def remaining(self) -> int:
        return self.total - len(self.finished)

    def resume_from(self, rows: list[dict], fresh: Iterator[PromptRequest]) -> str | None:
        """Check the kept `rows` against a fresh pass over the job's requests (tokenizing only those with
        a row) and skip their indices; why they don't belong to this job, or None."""
        kept = {row["index"] for row in rows}
        pending: dict[int, dict] = {}

        def with_rows() -> Iterator[PromptRequest]:
            for chunk in chunked(fresh, self.chunk_size):
                for request in self._tokenize([r for r in chunk if r.index in kept]):
                    pending[request.index] = self.sampling_for(request)
                    yield request

        mismatch = resume_mismatch(rows, with_rows(), pending.pop, self.total)
        if mismatch is None:
            self.finished = kept
        return mismatch
