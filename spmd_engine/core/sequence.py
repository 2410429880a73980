"""Requests as the scheduler sees them: sampling parameters and the per-sequence token/KV state.

Rank 0 only; plain Python so the scheduler can be tested without torch.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

FINISH_STOP = "stop"  # an EOS token was sampled
FINISH_LENGTH = "length"  # max_tokens or max_model_len reached
FINISH_ABORT = "abort"  # the client went away before the end


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


@dataclass
class SamplingParams:
    """How to pick tokens for one request: the one definition of the sampling parameters and their
    defaults (the public `SamplingParams`, the job's `sampling.*`, a prompts-file row's overrides).
    conf/config.yaml lists the same keys and values so that `sampling.KEY=VALUE` overrides exist on the
    command line; tests/spmd_engine/test_config.py checks that the two agree."""

    temperature: float = 0.6  # 0 = greedy
    top_p: float = 0.95  # nucleus mass in (0, 1]; 1 = off
    top_k: int = -1  # -1 or 0 = off
    max_tokens: int = 256  # generated tokens at most
    ignore_eos: bool = False
    seed: int | None = None  # per-request noise seed; None = one drawn from the engine `seed`

    def validate(self) -> "SamplingParams":
        """Raise ValueError (one line naming the field and the limit) for a value users got wrong."""
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature!r}")
        if math.isinf(self.temperature):
            raise ValueError(f"sampling.temperature must be >= 0 and finite, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"sampling.top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"sampling.ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"sampling.seed must be an integer in [-2**63, 2**64 - 1] or null, got {self.seed!r}")
        return self

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

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
        for name in ("temperature", "top_p"):
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
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))
