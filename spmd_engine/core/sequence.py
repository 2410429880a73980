"""Requests as the scheduler sees them: sampling parameters and the per-sequence token/KV state.

Rank 0 only; plain Python so the scheduler can be tested without torch.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from spmd_engine.structured.params import StructuredOutputsParams

FINISH_STOP = "stop"  # an EOS token was sampled
FINISH_LENGTH = "length"  # max_tokens or max_model_len reached
FINISH_ABORT = "abort"  # the client went away before the end
MAX_LOGPROBS = 20  # top alternatives per position at most (OpenAI's top_logprobs limit)
MAX_N = 1024  # completions of one request at most: each is a sequence held until the request ends


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


@dataclass
class SamplingParams:
    """How to pick tokens for one request: the one definition of the sampling parameters and their
    defaults (the public `SamplingParams`, the job's `sampling.*`, a prompts-file row's overrides).
    The composed config's `sampling.*` keys and values come from here (spmd_engine.config.config_defaults)."""

    temperature: float = 0.6  # 0 = greedy
    top_p: float = 0.95  # nucleus mass in (0, 1]; 1 = off
    top_k: int = -1  # -1 or 0 = off
    max_tokens: int = 256  # generated tokens at most
    ignore_eos: bool = False
    seed: int | None = None  # per-request noise seed; None = one drawn from the engine `seed`
    # stop conditions (vLLM semantics): `stop` strings are matched on the detokenized output, across
    # token boundaries, and cut from `text` unless include_stop_str_in_output; `stop_token_ids` end the
    # request like EOS (even with ignore_eos); none of them, EOS included, ends it before min_tokens
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    # log-probabilities: the top-k alternatives per generated token / per prompt position (None = off)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # logit transforms (vLLM semantics, spmd_engine/logits_processors.py): min_p keeps tokens with
    # p >= min_p * p_max; repetition_penalty divides positive / multiplies negative logits of tokens in
    # the prompt or output; frequency / presence penalties subtract per output occurrence / once
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # completions of the prompt (vLLM semantics): child i draws with seed + i, the prompt is prefilled once
    n: int = 1
    # output constrained to a JSON schema / JSON object / regex / choice / EBNF grammar (spmd_engine/structured):
    # a StructuredOutputsParams or a dict of its fields (validate() makes it the dataclass)
    structured_outputs: Any = None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # one string is a list of one (as in vLLM and OpenAI)
            self.stop = [self.stop]

    def validate(self) -> "SamplingParams":
        """Raise ValueError (one line naming the field and the limit) for a value users got wrong."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or math.isnan(getattr(self, name)):  # 'abc', NaN: no limit applies
                raise ValueError(f"sampling.{name} must be a number, got {getattr(self, name)!r}")
        for name in ("top_k", "max_tokens", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"sampling.{name} must be an integer, got {getattr(self, name)!r}")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature!r}")
        if math.isinf(self.temperature):
            raise ValueError(f"sampling.temperature must be >= 0 and finite, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"sampling.top_k must be -1 or 0 (off) or >= 1, got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"sampling.ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"sampling.seed must be an integer in [-2**63, 2**64 - 1] or null, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (not isinstance(self.stop, list)
                                      or not all(isinstance(s, str) and s for s in self.stop)):
            raise ValueError(f"sampling.stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.stop_token_ids is not None and (not isinstance(self.stop_token_ids, list)
                                                or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids)):
            raise ValueError(f"sampling.stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"sampling.min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError("sampling.include_stop_str_in_output must be true or false, got "
                             f"{self.include_stop_str_in_output!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"sampling.min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"sampling.repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"sampling.{name} must be in [-2, 2], got {value!r}")
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"sampling.n must be an integer in [1, {MAX_N}], got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"sampling.{name} must be an integer in [0, {MAX_LOGPROBS}] or null, got {value!r}")
        return self

    @classmethod
    def from_dict(
        cls, overrides: Mapping[str, Any], defaults: "SamplingParams | None" = None
    ) -> "SamplingParams":
        """`defaults` (or the dataclass defaults) with the keys of `overrides` replaced, validated."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in overrides:
            if key not in known:
                raise ValueError(
                    f"sampling.{key} is not a sampling parameter (known: {', '.join(sorted(known))})"
                )
        base = defaults if defaults is not None else cls()
        values = dict(overrides)
        # JSON and YAML give ints for floats like 1; keep the float fields float.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if _is_int(values.get(name)):
                values[name] = float(values[name])
        return dataclasses.replace(base, **values).validate()


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life: queued (or preempted), scheduled, done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request's tokens and how much of them is in the paged KV cache.

    `token_ids` always holds prompt + generated tokens, so a preempted sequence (whose blocks were
    freed) is recomputed by prefilling all of them again.
    """

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0  # leading tokens whose KV is in the cache or scheduled to be
    # sampled on the device but not yet read back (async scheduling plans ahead of the readback)
    num_pending_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at the last admission (metrics)
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None
    num_preemptions: int = 0
    # the sampler's noise seed: params.seed, or the one the engine drew for an unseeded request
    sampling_seed: int = 0
    stop_reason: str | int | None = None  # the stop string or stop token id that finished it (None: EOS)
    # a request's completion i > 0 (sampling.n): its first completion, whose computed prompt blocks it
    # shares at admission instead of prefilling them again (Scheduler._admit_waiting)
    fork_from: Sequence | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.seq_id}: the prompt must have at least 1 token, got 0")
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Known tokens plus those still being sampled: what the scheduler plans against."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))
