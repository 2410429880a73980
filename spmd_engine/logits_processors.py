"""Logit transforms applied on rank 0 between the LM head and the sampler (kept out of sampler.py).

Why here: the sampler draws from whatever logits it is given; request options that change the
distribution itself (min_tokens forbidding the stop tokens for now) are applied to the logits
first, each one a function of a row's own request and counter (batch-independent), and only for
rows that need it (a step without such rows costs nothing).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence as Seq

import torch

from spmd_engine.sequence import Sequence


def stop_tokens_of(seq: Sequence, eos_token_ids: Iterable[int]) -> list[int]:
    """The tokens that would end `seq`: EOS (unless ignore_eos) and its stop_token_ids."""
    tokens = set() if seq.params.ignore_eos else set(eos_token_ids)
    tokens.update(seq.params.stop_token_ids or ())
    return sorted(tokens)


def min_tokens_mask(picked: Seq[tuple[Sequence, int]], eos_token_ids: Iterable[int],
                    vocab_size: int) -> tuple[list[int], list[int]]:
    """(rows, columns) of the logits to set to -inf: the stop tokens of every row whose draw comes
    before its request's min_tokens (vLLM's MinTokensLogitsProcessor). `picked`: (sequence, position
    of the token being drawn) per logits row."""
    eos = list(eos_token_ids)
    rows: list[int] = []
    cols: list[int] = []
    for row, (seq, position) in enumerate(picked):
        if seq.params.min_tokens and position - seq.num_prompt_tokens < seq.params.min_tokens:
            for token in stop_tokens_of(seq, eos):
                if 0 <= token < vocab_size:
                    rows.append(row)
                    cols.append(token)
    return rows, cols


@torch.inference_mode()
def apply_min_tokens(logits: torch.Tensor, picked: Seq[tuple[Sequence, int]],
                     eos_token_ids: Iterable[int]) -> torch.Tensor:
    """Forbid the stop tokens of rows still short of min_tokens, in place; nothing to do: no work at all."""
    rows, cols = min_tokens_mask(picked, eos_token_ids, logits.shape[-1])
    if rows:
        index = torch.tensor([rows, cols], dtype=torch.int64)
        if logits.device.type == "cuda":
            index = index.pin_memory().to(logits.device, non_blocking=True)
        logits[index[0], index[1]] = float("-inf")
    return logits
