"""Incremental detokenization and stop-string matching of one request's output (rank 0).

Why: a stop string can span token boundaries and must end generation the step it appears, so the
text is followed as tokens arrive; decoding the whole output again at every token would cost
O(n^2) over a long output. Each token here decodes only a short window of recent tokens (the
last emitted piece plus whatever is still an incomplete character), and the matcher only looks at
the new text plus the longest stop string's length of the old.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

INCOMPLETE = "\ufffd"  # what a decoder gives for the first bytes of a character split across tokens
PROMPT_CONTEXT_TOKENS = 4  # prompt tokens decoded in front of the output (leading-space rules of some tokenizers)


@dataclass
class IncrementalDetokenizer:
    """The output text, one token at a time; `decode(ids)` is the tokenizer's decode (special tokens skipped).

    The window `ids[prefix:]` is decoded and compared with `ids[prefix:read]` (text already emitted): what
    it adds is the new text, held back while it ends in an incomplete character.
    """

    decode: Callable[[list[int]], str]
    prompt_tail: list[int] = field(default_factory=list)
    text: str = ""
    _ids: list[int] = field(init=False)
    _prefix: int = field(init=False, default=0)
    _read: int = field(init=False)

    def __post_init__(self) -> None:
        self._ids = list(self.prompt_tail[-PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._ids)

    def add(self, token_id: int) -> str:
        """Take one token; return the text it completes ("" while a character is still incomplete)."""
        self._ids.append(int(token_id))
        before = self.decode(self._ids[self._prefix:self._read]) if self._read > self._prefix else ""
        now = self.decode(self._ids[self._prefix:])
        if len(now) <= len(before) or now.endswith(INCOMPLETE):
            return ""
        delta = now[len(before):]
        self.text += delta
        # the next window starts at this piece: bounded, whatever the output's length
        del self._ids[:self._read]
        self._prefix, self._read = 0, len(self._ids)
        return delta


@dataclass(frozen=True)
class StopMatch:
    """Where a stop string matched: the string, and the text to report (cut before or after it)."""

    stop: str
    text: str


class StopStringMatcher:
    """Finds the first stop string in a growing text, looking only at the tail that can hold a new match."""

    def __init__(self, stops: list[str], include_in_output: bool) -> None:
        self.stops = list(stops)
        self.include = include_in_output
        self.longest = max(len(s) for s in self.stops)

    def check(self, text: str, new_chars: int) -> StopMatch | None:
        """The earliest match that ends inside the last `new_chars` characters of `text`, or None."""
        if new_chars <= 0:
            return None
        start = max(0, len(text) - new_chars - self.longest + 1)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = text.find(stop, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        return StopMatch(stop, text[:at + len(stop)] if self.include else text[:at])


class OutputText:
    """One request's detokenizer and stop matcher; `add` says which stop string the token completed."""

    def __init__(self, decode: Callable[[list[int]], str], prompt_token_ids: list[int], stops: list[str],
                 include_in_output: bool) -> None:
        self.detokenizer = IncrementalDetokenizer(decode, prompt_token_ids)
        self.matcher = StopStringMatcher(stops, include_in_output)
        self.match: StopMatch | None = None

    def add(self, token_id: int, check: bool) -> StopMatch | None:
        """Feed one output token; with `check` (min_tokens reached) look for a stop string in the new text."""
        delta = self.detokenizer.add(token_id)
        if check and self.match is None:
            self.match = self.matcher.check(self.detokenizer.text, len(delta))
            return self.match
        return None


def text_token_ids(token_ids: list[int], finish_reason: str | None, stop_reason: Any,
                   include_stop_str_in_output: bool) -> list[int]:
    """The output tokens whose text `text` holds: all of them, but the token that ended the request
    (EOS or a stop token id) left out unless include_stop_str_in_output (vLLM's rule; `token_ids`
    keep it). Why: a stop token id may be an ordinary token, whose text skip_special_tokens keeps."""
    ended_by_token = finish_reason == "stop" and not isinstance(stop_reason, str)
    if ended_by_token and not include_stop_str_in_output and token_ids:
        return token_ids[:-1]
    return token_ids
