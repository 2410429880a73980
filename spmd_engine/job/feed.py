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
from spmd_engine.job.outputs import resume_mismatch, row_key
from spmd_engine.job.prompt_chars import PromptCharLimit, prompt_char_limit
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


def row_error(row: dict) -> bool:
    """An error row: the request's only row, whatever its sampling.n (it never ran)."""
    return row.get("finish_reason") == "error"


@dataclass
class RequestFeed:
    """The job's requests as chunks to hand out: resumed indices dropped, text tokenized per chunk, each
    request's sampling kept until its row is written (`sampling_of` pops it)."""

    cfg: EngineConfig
    tokenizer: Any
    requests: Iterator[PromptRequest]
    total: int  # requests in the job, finished ones of a resumed job included
    chunk_size: int = CHUNK_REQUESTS
    finished: set[int] = field(default_factory=set)  # resume: indices with every completion in outputs.jsonl
    kinds: dict[int, str | None] = field(default_factory=dict)  # output_format=openai: each index's API
    kept_completions: dict[int, set[int]] = field(default_factory=dict)  # resume: index -> sample indices kept
    max_model_len: int | None = None  # the engine's: text prompts longer than it can hold are not tokenized
    _sampling: dict[int, list] = field(default_factory=dict)  # index -> [sampling, rows still to write]
    _char_limit: PromptCharLimit | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._char_limit = prompt_char_limit(self.tokenizer, self.max_model_len)

    def sampling_for(self, request: PromptRequest) -> dict:
        sampling = {**vars(self.cfg.sampling), **request.overrides}
        if hasattr(sampling.get("structured_outputs"), "to_dict"):  # the job-wide default: its fields, as JSON
            sampling["structured_outputs"] = sampling["structured_outputs"].to_dict()
        return sampling

    def where(self, index: int) -> str | None:
        """Where request `index` was written, as its error rows name it (line N of a prompts file is
        request N - 1), or None for requests the job made itself (the built-in prompts, a benchmark)."""
        if self.cfg.workload.name == "bench":
            return None
        if self.cfg.prompts_file is not None:
            return f"prompts_file line {index + 1}"
        return f"prompts[{index}]" if self.cfg.prompts is not None else None

    def located(self, row: dict) -> dict:
        """`row` with its error naming the request's line: errors found after reading (tokenizing, the
        engine's checks of length, vocabulary and sampling) say where as those of the reader do."""
        where, error = self.where(row["index"]), row.get("error")
        if error and where and not error.startswith(f"{where}: "):
            row["error"] = f"{where}: {error}"
        return row

    def sampling_of(self, index: int) -> dict | None:
        """The sampling of a request handed out, for each of its rows (dropped after the last one)."""
        entry = self._sampling.get(index)
        if entry is None:
            return None
        entry[1] -= 1
        if entry[1] <= 0:
            del self._sampling[index]
        return entry[0]

    def _hand_out(self, request: PromptRequest) -> bool:
        """Note a request to run (its sampling kept for its rows); a resumed one runs only the completions
        outputs.jsonl lacks. False: nothing of it is left to run."""
        sampling = self.sampling_for(request)
        n = sampling.get("n", 1)
        n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1  # a bad n: one error row
        kept = self.kept_completions.get(request.index, set())
        missing = [i for i in range(n) if i not in kept]
        if not missing:
            return False
        if kept:
            request.completions = tuple(missing)
        self._sampling[request.index] = [sampling, len(missing)]
        return True

    def _tokenize(self, requests: list[PromptRequest]) -> list[PromptRequest]:
        return tokenize(requests, self.tokenizer, self.cfg.chat_template, self.cfg.chat_template_kwargs,
                        self._char_limit)

    def chunks(self) -> Iterator[list[PromptRequest]]:
        """Chunks of at most chunk_size requests to run, read and tokenized only when asked for."""
        for chunk in chunked(self.requests, self.chunk_size):
            todo = [r for r in chunk if r.index not in self.finished and self._hand_out(r)]
            self._tokenize(todo)
            if self.cfg.output_format == "openai":
                self.kinds.update((request.index, request.api) for request in todo)
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
        kept: dict[int, set[int]] = {}
        for row in rows:
            kept.setdefault(row["index"], set()).add(row_key(row)[1])
        pending: dict[int, dict] = {}
        finished: set[int] = set()

        def with_rows() -> Iterator[PromptRequest]:
            for chunk in chunked(fresh, self.chunk_size):
                for request in self._tokenize([r for r in chunk if r.index in kept]):
                    pending[request.index] = sampling = self.sampling_for(request)
                    n = sampling.get("n", 1)
                    if request.index in errored or (isinstance(n, int) and set(range(n)) <= kept[request.index]):
                        finished.add(request.index)
                    yield request

        errored = {row["index"] for row in rows if row_error(row)}
        mismatch = resume_mismatch(rows, with_rows(), pending.pop, self.total)
        if mismatch is None:
            self.finished, self.kept_completions = finished, kept
        return mismatch
