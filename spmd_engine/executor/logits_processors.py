"""Logit transforms applied on rank 0 between the LM head and the sampler (kept out of sampler.py).

Why here: the sampler draws from whatever logits it is given; request options that change the
distribution itself (min_tokens forbidding the stop tokens for now) are applied to the logits
first, each one a function of a row's own request and counter (batch-independent), and only for
rows that need it (a step without such rows costs nothing).
"""
from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence as Seq

import torch

from spmd_engine.core.sequence import Sequence
from spmd_engine.executor.device_copy import to_device_async


def stop_tokens_of(seq: Sequence, eos_token_ids: Iterable[int]) -> list[int]:
    """The tokens that would end `seq`: EOS (unless ignore_eos) and its stop_token_ids."""
    tokens = set() if seq.params.ignore_eos else set(eos_token_ids)
    tokens.update(seq.params.stop_token_ids or ())
    return sorted(tokens)


def min_tokens_mask(picked: Seq[tuple[Sequence, int]], eos_token_ids: Iterable[int],
                    vocab_size: int, exempt: Collection[int] = ()) -> tuple[list[int], list[int]]:
    """(rows, columns) of the logits to set to -inf: the stop tokens of every row whose draw comes
    before its request's min_tokens (vLLM's MinTokensLogitsProcessor). `picked`: (sequence, position
    of the token being drawn) per logits row; `exempt`: rows left alone (a grammar that allows only its stop
    tokens: the constrained output is complete, min_tokens cannot add to it)."""
    eos = list(eos_token_ids)
    rows: list[int] = []
    cols: list[int] = []
    for row, (seq, position) in enumerate(picked):
        if row in exempt:
            continue
        if seq.params.min_tokens and position - seq.num_prompt_tokens < seq.params.min_tokens:
            for token in stop_tokens_of(seq, eos):
                if 0 <= token < vocab_size:
                    rows.append(row)
                    cols.append(token)
    return rows, cols


@torch.inference_mode()
def apply_min_tokens(logits: torch.Tensor, picked: Seq[tuple[Sequence, int]],
                     eos_token_ids: Iterable[int], exempt: Collection[int] = ()) -> torch.Tensor:
    """Forbid the stop tokens of rows still short of min_tokens (but `exempt`), in place; nothing to do: no work."""
    rows, cols = min_tokens_mask(picked, eos_token_ids, logits.shape[-1], exempt)
    if rows:
        index = to_device_async(torch.tensor([rows, cols], dtype=torch.int64), logits.device)
        logits[index[0], index[1]] = float("-inf")
    return logits


def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.as_tensor(r, dtype=torch.int64)
    return out


@torch.inference_mode()
def apply_penalties_and_min_p(logits: torch.Tensor, picked: Seq[tuple[Sequence, int]],
                              min_temperature: float = 1e-5) -> torch.Tensor:
    """vLLM's repetition / frequency / presence penalties and min_p, in place, for the rows that set any.

    Penalties look at the request's output tokens before the one being drawn (all on the host when a
    step is sampled: the previous step's tokens are post-processed first, also with async
    scheduling) and, for repetition_penalty, its prompt. min_p is applied to the penalised logits in
    logit space with the row's temperature: p_i < min_p * p_max  <=>  z_i < z_max + T * ln(min_p),
    so the sampler's own temperature division sees exactly vLLM's mask. Rows setting none: no work.
    """
    pen = [i for i, (s, _) in enumerate(picked) if s.params.has_penalties]
    if pen:
        _apply_penalties(logits, picked, pen)
    mp = [i for i, (s, _) in enumerate(picked) if s.params.min_p > 0 and s.params.temperature >= min_temperature]
    if mp:
        margins = [math.log(picked[i][0].params.min_p) * picked[i][0].params.temperature for i in mp]
        apply_min_p(logits, mp, margins)
    return logits


def _rows_of(logits: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logits of `rows`: a view of them all when `rows` is every row in order (a step whose rows all
    ask: no [N, V] gather and scatter back), else a gathered copy and its device index."""
    if rows == list(range(logits.shape[0])):
        return logits, None
    index = to_device_async(torch.as_tensor(rows, dtype=torch.int64), logits.device)
    return logits.index_select(0, index), index


def apply_min_p(logits: torch.Tensor, rows: list[int], margins: list[float]) -> torch.Tensor:
    """min_p in place on `rows`: every logit below the row's maximum + its margin (T * ln(min_p)) is -inf.
    The margins are rounded to float32, the logits' dtype, as the mask compares in it."""
    margin = to_device_async(torch.tensor(margins, dtype=torch.float32), logits.device)
    z, index = _rows_of(logits, rows)
    cut = z.max(dim=-1, keepdim=True).values + margin[:, None]
    if index is None:
        return logits.masked_fill_(logits < cut, float("-inf"))
    logits.index_copy_(0, index, z.masked_fill_(z < cut, float("-inf")))
    return logits


def _apply_penalties(logits: torch.Tensor, picked: Seq[tuple[Sequence, int]], pen: list[int]) -> None:
    """The penalties of rows `pen`, in place; a term no row sets is skipped (z * 1 and z - 0 are z, so
    the result is the same bits)."""
    vocab, dev = logits.shape[-1], logits.device
    params = [picked[i][0].params for i in pen]
    repeat = any(p.repetition_penalty != 1.0 for p in params)
    additive = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
    if not (repeat or additive):
        return
    outputs, prompts = [], []
    for i in pen:
        seq, position = picked[i]
        drawn = position - seq.num_prompt_tokens  # output tokens before this draw
        outputs.append(seq.token_ids[seq.num_prompt_tokens:seq.num_prompt_tokens + drawn])
        prompts.append(seq.prompt_token_ids if seq.params.repetition_penalty != 1.0 else [])
    host = torch.tensor([[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                         [p.presence_penalty for p in params]], dtype=torch.float32)
    rep, freq, pres = to_device_async(host, dev)
    z, index = _rows_of(logits, pen)
    counts = torch.zeros(len(pen), vocab + 1, dtype=torch.float32, device=dev)
    out_ids = to_device_async(_padded(outputs, vocab), dev)  # padding counts into the extra column
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
    counts = counts[:, :vocab]
    if repeat:
        seen = torch.zeros(len(pen), vocab + 1, dtype=torch.bool, device=dev)
        seen.scatter_(1, to_device_async(_padded(prompts, vocab), dev), True)
        seen = seen[:, :vocab] | (counts > 0)
        factor = torch.where(z > 0, 1.0 / rep[:, None], rep[:, None])
        z.mul_(torch.where(seen, factor, 1.0))  # = where(seen, z * factor, z)
    if additive:
        z.sub_(freq[:, None] * counts).sub_(pres[:, None] * (counts > 0).float())
    if index is not None:
        logits.index_copy_(0, index, z)
