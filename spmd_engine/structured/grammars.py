"""Rank 0's grammar side of structured outputs (xgrammar): compiling, per-sequence matchers, token bitmasks.

- `GrammarCompilerPool`: compiled grammars cached by (kind, text); compilation runs on a thread pool, so the
  step loop keeps stepping the running batch while a new schema compiles (a request joins the batch once its
  grammar is ready). A bad schema, regex or grammar comes back as the future's `GrammarError` (one line).
- `GrammarState`: one sequence's matcher, advanced by the scheduler with each token it appends (as a stop
  string's text is); `accept` says when the grammar has ended. Recompute preemption keeps a sequence's tokens,
  so the matcher never goes back; a matcher that disagrees with its sequence's output is rebuilt from it.
- `GrammarMasks`: a step's bitmask rows filled on the host (xgrammar's batch fill, several threads) while the
  forward runs, copied beside it (CUDA: its own stream) and applied to the logits in place
  (kernels/token_bitmask.py on CUDA, the torch reference elsewhere) before any other logit transform.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import threading
import time
from collections.abc import Iterable, Sequence as Seq
from typing import Any

import numpy as np
import torch

from spmd_engine.structured.params import FIELD, StructuredOutputsParams

COMPILE_THREADS = 2  # grammar compilations at once (off the step loop)
FILL_THREADS = max(1, min(4, os.cpu_count() or 1))  # threads of xgrammar's batch bitmask fill
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+:[0-9]+: ")


class GrammarError(ValueError):
    """A schema, regex or grammar that does not compile: the request's one-line error."""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CPP_PREFIX.sub("", text)[:300]


def choice_grammar(choices: Seq[str]) -> str:
    """EBNF whose language is exactly the given strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompilerPool:
    """xgrammar's compiler for one tokenizer and vocabulary, with a cache of futures keyed by (kind, text)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 threads: int = COMPILE_THREADS) -> None:
        """Cheap: xgrammar reads the vocabulary at the first compilation, on the pool's thread."""
        self.tokenizer, self.vocab_size, self.threads = tokenizer, vocab_size, threads
        self.stop_token_ids = sorted(set(int(t) for t in stop_token_ids))
        self.compiler: Any = None
        self.vocabulary_seconds: float | None = None  # the tokenizer's vocabulary read by xgrammar
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()
        self._cache: dict[tuple[str, str], concurrent.futures.Future] = {}
        self.compile_seconds: dict[tuple[str, str], float] = {}  # each compiled grammar's compile time

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compiled grammar of `params` (a future: done at once when cached)."""
        key = params.key()
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._pool.submit(self._compile, key)
        return future

    def _compiler(self) -> Any:
        with self._compiler_lock:  # not the cache's lock: `submit` never waits for the vocabulary
            if self.compiler is None:
                import xgrammar as xgr

                start = time.perf_counter()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self.compiler = xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=False)
                self.vocabulary_seconds = time.perf_counter() - start
            return self.compiler

    def _compile(self, key: tuple[str, str]) -> Any:
        kind, text = key
        compiler = self._compiler()
        start = time.perf_counter()
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(json.loads(text)))
            else:
                compiled = compiler.compile_grammar(text)
        except Exception as exc:  # xgrammar raises RuntimeError (and others) with a C++ location prefix
            raise GrammarError(f"{FIELD}.{kind} does not compile: {_one_line(exc)}") from None
        self.compile_seconds[key] = time.perf_counter() - start
        return compiled

    def matcher(self, compiled: Any) -> "GrammarState":
        return GrammarState(compiled, self.stop_token_ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One sequence's grammar matcher and how many of its output tokens it has taken."""

    __slots__ = ("compiled", "stop_token_ids", "matcher", "num_accepted", "ended")

    def __init__(self, compiled: Any, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self.compiled, self.stop_token_ids = compiled, stop_token_ids
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)
        self.num_accepted = 0
        self.ended = False

    def accept(self, token: int) -> bool:
        """Advance by one output token; True once the grammar has ended: its stop token was taken, or a token
        it cannot take (which its mask never allows) was appended anyway."""
        self.num_accepted += 1
        if self.ended:
            return True
        if not self.matcher.accept_token(int(token)) or self.matcher.is_terminated():
            self.ended = True
        return self.ended

    def rebuild(self, output_token_ids: Seq[int]) -> None:
        """A fresh matcher that has taken `output_token_ids` (the sequence's output so far)."""
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(self.compiled, override_stop_tokens=self.stop_token_ids)
        self.num_accepted, self.ended = 0, False
        for token in output_token_ids:
            self.accept(token)


class GrammarMasks:
    """The bitmask rows of a step's constrained logits rows: filled on the host, applied on the device."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        import xgrammar as xgr

        self.vocab_size, self.device = vocab_size, device
        self.words = (vocab_size + 31) // 32
        self._batch = xgr.BatchGrammarMatcher(FILL_THREADS)
        cuda = device.type == "cuda"
        self._host: list[torch.Tensor | None] = [None, None]  # two host buffers, used in turn
        self._copied = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._turn = 0

    def _buffer(self, rows: int) -> torch.Tensor:
        turn = self._turn = 1 - self._turn
        host = self._host[turn]
        if host is None or host.shape[0] < rows:
            size = max(rows, 64)
            host = torch.empty(size, self.words, dtype=torch.int32, pin_memory=self._stream is not None)
            self._host[turn] = host
        elif self._copied is not None:
            self._copied[turn].synchronize()  # its copy of two steps ago (long done: that step was read back)
        return host

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, rows: list[int], states: list[GrammarState],
              stop_tokens: list[list[int] | None]) -> list[int]:
        """-inf, in place, for every token the grammar of logits row rows[i] (states[i]) does not allow next.
        Returns the rows whose grammar allows nothing but their stop tokens (`stop_tokens[i]`; None: not asked)."""
        live = [(r, s, stops) for r, s, stops in zip(rows, states, stop_tokens) if not s.ended]
        if not live or logits is None:
            return []
        host = self._buffer(len(live))
        matchers = [s.matcher for _, s, _ in live]
        self._batch.batch_fill_next_token_bitmask(matchers, host, list(range(len(live))))
        mask = host[:len(live)]
        complete = [r for i, (r, _, stops) in enumerate(live)
                    if stops is not None and self._only(mask[i].numpy(), stops)]
        index = torch.tensor([r for r, _, _ in live], dtype=torch.int64)
        if self._stream is None:
            from spmd_engine.kernels.reference import apply_token_bitmask_reference
            apply_token_bitmask_reference(logits, mask, index)
            return complete
        from spmd_engine.kernels.token_bitmask import apply_token_bitmask
        with torch.cuda.stream(self._stream):  # beside the forward in flight: the mask is host data only
            dev_mask = mask.to(self.device, non_blocking=True)
            dev_index = index.pin_memory().to(self.device, non_blocking=True)
        self._copied[self._turn].record(self._stream)
        torch.cuda.current_stream(self.device).wait_event(self._copied[self._turn])
        dev_mask.record_stream(torch.cuda.current_stream(self.device))
        dev_index.record_stream(torch.cuda.current_stream(self.device))
        apply_token_bitmask(logits, dev_mask, dev_index)
        return complete

    def _only(self, words: np.ndarray, tokens: list[int]) -> bool:
        """Whether the bitmask row `words` allows no token but (some of) `tokens`."""
        rest = words.view(np.uint32).copy()
        for t in tokens:
            if 0 <= t < 32 * len(rest):
                rest[t >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (t & 31)))
        return not rest.any()


def warm_up_mask_kernel(vocab_size: int, device: torch.device) -> None:
    """Compile the bitmask kernel for this vocabulary at start-up (CUDA), not at a job's first structured step:
    the shapes and alignments a step passes (float32 logits rows of `vocab_size`, a fresh mask and row index)."""
    if device.type != "cuda":
        return
    from spmd_engine.kernels.token_bitmask import apply_token_bitmask

    logits = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)
    mask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=device)
    apply_token_bitmask(logits, mask, torch.zeros(1, dtype=torch.int64, device=device))
