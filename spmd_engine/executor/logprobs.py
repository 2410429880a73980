"""Log-probabilities of generated and prompt tokens (sampling.logprobs / sampling.prompt_logprobs).

Semantics (vLLM's default, `raw_logprobs`): log_softmax of the model's raw float32 logits, the very
logits the sampler gets, before temperature, top-k/top-p, min_tokens or any other transform; so
with greedy sampling the chosen token's logprob is the row's maximum. Rank 0 computes them on the
logits' device and reads them back with the step's tokens; requests that ask for none cost
nothing (no extra rows, kernels or copies).

Prompt logprobs need logits at every prompt position, not only the last: the plan carries, per
sequence, how many leading positions of this chunk predict a prompt token (`StepPlan.prompt_logits`),
every rank passes those hidden rows through the LM head too (its gather is collective under tensor
parallelism) and rank 0 turns them into logprobs. Chunked prefill simply contributes each chunk's
positions; such requests skip the prefix cache (a cached position has no logits).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from spmd_engine.executor.device_copy import to_device_async


def host_to_device(values, device: torch.device) -> torch.Tensor:
    """Small int64 index data on `device` without waiting for the GPU (pinned, non-blocking: a pageable
    copy would wait for the queued forward)."""
    return to_device_async(torch.as_tensor(np.asarray(values, dtype=np.int64)), device)


LOGPROB_ROWS_PER_CHUNK = 1024  # prompt rows log-softmaxed at a time: bounds the extra [rows, vocab] memory


def prompt_logit_rows(query_lens: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Rows of the step's hidden states (token order) that get prompt logits: the first counts[b]
    tokens of each sequence b."""
    starts = np.zeros(len(query_lens), dtype=np.int64)
    np.cumsum(query_lens[:-1], out=starts[1:])
    counts = counts.astype(np.int64)
    if not counts.any():
        return np.zeros(0, dtype=np.int64)
    offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + offsets


@dataclass
class PendingLogprobs:
    """Logprobs queued on the device for some rows of a step; `host` reads them back (waits)."""

    chosen: torch.Tensor  # [R] float32: logprob of each row's token
    top_ids: torch.Tensor  # [R, k] int64
    top_logprobs: torch.Tensor  # [R, k] float32

    def host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.chosen.cpu().numpy(), self.top_ids.cpu().numpy(), self.top_logprobs.cpu().numpy()


@torch.inference_mode()
def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> PendingLogprobs:
    """logits [R, V] (raw, float32), tokens [R] -> each token's logprob and the top-k (k may be 0);
    in row chunks, so a long prompt chunk needs one chunk's log-softmax at a time, not a second [R, V]."""
    chosen, top_ids, top_logprobs = [], [], []
    for lo in range(0, logits.shape[0], LOGPROB_ROWS_PER_CHUNK):
        logprobs = torch.log_softmax(logits[lo:lo + LOGPROB_ROWS_PER_CHUNK].float(), dim=-1)
        mine = tokens[lo:lo + LOGPROB_ROWS_PER_CHUNK].view(-1, 1).to(torch.int64)
        chosen.append(logprobs.gather(1, mine).squeeze(1))
        if k > 0:
            values, ids = logprobs.topk(k, dim=-1)
        else:
            values = logprobs.new_zeros(logprobs.shape[0], 0)
            ids = torch.zeros(logprobs.shape[0], 0, dtype=torch.int64, device=logprobs.device)
        top_logprobs.append(values)
        top_ids.append(ids)
    return PendingLogprobs(torch.cat(chosen), torch.cat(top_ids), torch.cat(top_logprobs))


@dataclass
class SampledLogprobRows:
    """The rows of a step's sampled logits whose requests asked for logprobs, log-softmaxed before any
    logit transform; the chosen tokens are gathered once the sampler has drawn them."""

    rows: list[int]  # into the step's sampled rows
    logprobs: torch.Tensor  # [len(rows), V] float32
    k: int  # the largest top-k asked for among them

    @staticmethod
    def take(logits: torch.Tensor | None, wanted: Seq[int | None]) -> "SampledLogprobRows | None":
        """Log-softmax the rows whose `wanted` k is not None; None (and no work) when no row wants any."""
        rows = [i for i, k in enumerate(wanted) if k is not None]
        if not rows or logits is None:
            return None
        with torch.inference_mode():
            picked = logits if len(rows) == logits.shape[0] else logits[host_to_device(rows, logits.device)]
            logprobs = torch.log_softmax(picked.float(), dim=-1)
        return SampledLogprobRows(rows, logprobs, max(wanted[i] for i in rows))

    @torch.inference_mode()
    def finish(self, tokens: torch.Tensor) -> PendingLogprobs:
        """Gather the sampled tokens' logprobs and the top-k (queued, no wait)."""
        mine = tokens if len(self.rows) == tokens.shape[0] else tokens[host_to_device(self.rows, tokens.device)]
        chosen = self.logprobs.gather(1, mine.view(-1, 1).to(torch.int64)).squeeze(1)
        top_logprobs, top_ids = self.logprobs.topk(self.k, dim=-1) if self.k else (
            self.logprobs.new_zeros(len(self.rows), 0),
            torch.zeros(len(self.rows), 0, dtype=torch.int64, device=self.logprobs.device))
        return PendingLogprobs(chosen, top_ids, top_logprobs)


def entry(token_id: int, logprob: float, top_ids: np.ndarray, top_logprobs: np.ndarray, k: int,
          token_text: Callable[[int], str] | None) -> dict:
    """One position's JSON entry: the token, its logprob and the top k alternatives (ids, logprobs, text)."""
    def text(t: int) -> str | None:
        return token_text(t) if token_text is not None else None

    return {"token_id": int(token_id), "token": text(int(token_id)), "logprob": float(logprob),
            "top_logprobs": [{"token_id": int(t), "token": text(int(t)), "logprob": float(lp)}
                             for t, lp in zip(top_ids[:k].tolist(), top_logprobs[:k].tolist())]}
