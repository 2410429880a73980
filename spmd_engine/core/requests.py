"""What one request is and what comes back for it: the engine's input and output records.

Why here, in core: the engine admits PromptRequests and returns RequestOutputs; the job (prompt
files, outputs.jsonl) builds and writes them, so both sides import them from here and the engine
never imports the job.
"""
from __future__ import annotations

import copy
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

# What an error row echoes of its request: a 5 MB prompt that fails must not become a 15 MB row.
ERROR_ECHO_CHARS = 200  # first characters of `prompt`; `prompt_chars` then holds the full length
ERROR_ECHO_TOKENS = 64  # first `prompt_token_ids`; `prompt_num_tokens` then holds the full count
ERROR_TEXT_CHARS = 1000  # the `error` line itself


OPTIONAL_FIELDS = ("stop_reason", "custom_id", "logprobs", "prompt_logprobs", "sample_index")


@dataclass
class RequestOutput:
    index: int
    prompt: str | None
    prompt_token_ids: list[int] | None
    text: str | None
    token_ids: list[int]
    finish_reason: str  # stop | length | error
    error: str | None = None
    # timing (seconds, relative to the generate call's start); not written to outputs.jsonl
    first_token_time: float | None = field(default=None, repr=False)
    token_times: list[float] = field(default_factory=list, repr=False)
    num_cached_tokens: int = field(default=0, repr=False)
    # written only when set, so rows of requests that use none of them keep their fields
    stop_reason: str | int | None = None  # the stop string / stop token id that ended it (finish_reason stop)
    custom_id: str | None = None  # the request's id in an OpenAI batch file
    logprobs: list[dict] | None = None  # per generated token (sampling.logprobs), see spmd_engine/logprobs.py
    prompt_logprobs: list[dict | None] | None = None  # per prompt token, None for the first
    # which completion of the request (sampling.n > 1 only; None for n = 1, whose rows keep their fields)
    sample_index: int | None = None

    @property
    def order(self) -> tuple[int, int]:
        """Where the row goes in outputs.jsonl and in a generate call's result: by request, then completion."""
        return self.index, self.sample_index or 0

    def to_json(self) -> dict:
        """The outputs.jsonl row: the written fields in declaration order, copied (the caller may keep
        or change the row). Built field by field: `asdict` deep-copies every token id one call at a
        time: 1.1 ms for a request of 550 prompt and 550 output tokens (4 us so), on rank 0's step path."""
        d = {}
        for name in _ROW_FIELDS:
            value = getattr(self, name)
            if value is None and name in OPTIONAL_FIELDS:
                continue
            d[name] = list(value) if name in _ID_LISTS and value is not None else copy.deepcopy(value)
        if self.finish_reason == "error":
            d.update(error_echo(self.prompt, self.prompt_token_ids))
            if self.error is not None and len(self.error) > ERROR_TEXT_CHARS:
                d["error"] = self.error[:ERROR_TEXT_CHARS] + "..."
        return d


_NOT_WRITTEN = ("first_token_time", "token_times", "num_cached_tokens")  # timing: metrics.json only
_ROW_FIELDS = tuple(f.name for f in fields(RequestOutput) if f.name not in _NOT_WRITTEN)
_ID_LISTS = ("prompt_token_ids", "token_ids")  # lists of ints: a shallow copy is a full one


def error_echo(prompt: str | None, prompt_token_ids: list[int] | None) -> dict:
    """The prompt fields of an error row: capped, with the full lengths added where a cap cut them."""
    echo: dict[str, Any] = {"prompt": prompt, "prompt_token_ids": prompt_token_ids}
    if prompt is not None and len(prompt) > ERROR_ECHO_CHARS:
        echo.update(prompt=prompt[:ERROR_ECHO_CHARS], prompt_chars=len(prompt))
    if prompt_token_ids is not None and len(prompt_token_ids) > ERROR_ECHO_TOKENS:
        echo.update(prompt_token_ids=list(prompt_token_ids[:ERROR_ECHO_TOKENS]),
                    prompt_num_tokens=len(prompt_token_ids))
    return echo


@dataclass
class PromptRequest:
    """One request as read: text or token ids, sampling overrides, or the one-line reason it can't run."""

    index: int  # position in the job's request list (outputs are reported in this order)
    prompt: str | None
    prompt_token_ids: list[int] | None
    overrides: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    # chat input: rendered by the tokenizer's chat template (with the generation prompt) at tokenize time
    messages: list[dict[str, str]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # this line's template options (over the job's)
    custom_id: str | None = None  # the OpenAI batch line's id, echoed in its output row
    api: str | None = None  # an OpenAI batch line's endpoint: "chat" | "completions" (None: our own line)
    # which of its sampling.n completions to run (a resumed job's missing ones); None: all of them
    completions: tuple[int, ...] | None = None


class NotYet(enum.Enum):
    """A polled request source's "nothing ready now, ask again later" (see `PolledRequests`)."""

    NOT_YET = "not yet"


NOT_YET = NotYet.NOT_YET


@runtime_checkable
class PolledRequests(Protocol):
    """A request source the engine polls, for work that arrives while the batch runs (a replica's chunks
    handed out by rank 0).

    Why not a plain iterator: `next()` can only block or end, and a replica that blocked for its next
    chunk would stop stepping the sequences it already runs. `poll(wait=False)` may answer NOT_YET (the
    engine keeps stepping and polls again next step); the engine passes `wait=True` only when it has
    nothing running, and then the answer is a request or None (no more requests, ever)."""

    def poll(self, wait: bool) -> PromptRequest | None | NotYet: ...


@dataclass
class IteratedRequests:
    """A plain iterable as a `PolledRequests`: always ready (a read may block), None at its end."""

    requests: Iterable[PromptRequest]

    def __post_init__(self) -> None:
        self._it = iter(self.requests)

    def poll(self, wait: bool) -> PromptRequest | None:
        return next(self._it, None)


def polled(requests: Iterable[PromptRequest] | PolledRequests) -> PolledRequests:
    """`requests` as the engine pulls them: a `PolledRequests` as is, any other iterable wrapped."""
    return requests if isinstance(requests, PolledRequests) else IteratedRequests(requests)


def shorten(text: str, limit: int = 60) -> str:
    """`text` cut to `limit` characters for an error line (a hostile line must not make a huge one)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def validate_prompt(token_ids: list[int], vocab_size: int, max_model_len: int) -> str | None:
    """One error line, or None if the prompt fits: non-empty, ids in the vocabulary, room to generate one token."""
    if len(token_ids) == 0:
        return "prompt is empty"
    try:  # the common case in two C loops (checked at every admission, on the step path)
        inside = 0 <= min(token_ids) and max(token_ids) < vocab_size
    except TypeError:
        inside = False  # something that is not a number: the loop below meets it as before
    for position, token in enumerate(() if inside else token_ids):  # the first id outside, for the message
        if not 0 <= token < vocab_size:
            return f"prompt_token_ids[{position}]={shorten(str(token), 24)} is outside the vocabulary [0, {vocab_size})"
    if len(token_ids) >= max_model_len:
        return f"prompt has {len(token_ids)} tokens; max_model_len={max_model_len} allows at most {max_model_len - 1}"
    return None
