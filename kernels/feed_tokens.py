"""The input ids a step's previous step sampled, written in on the device: one launch, no host sync.

Why: with async scheduling a decode row's input is the token the step still in flight draws, known on
the device only. `feed_rows[i]` names where token i's id comes from: -1 (the plan's own id) or row r
of the previous step's sampled tokens. The decode CUDA graphs run this as their first kernel over the
runner's persistent token feed (the sampler graphs draw straight into it), so nothing eager runs
between a step's draw and the next step's graph; the eager and piecewise steps launch it before their
forward. Reference: `kernels.reference.feed_tokens_reference` (the CPU path).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.pdl import pdl_launch, pdl_prologue

BLOCK = 1024


@triton.jit
def _feed_tokens_kernel(input_ids, feed_rows, feed, num_tokens, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.load(feed_rows + offs, mask=offs < num_tokens, other=-1)
    fed = rows >= 0
    tokens = tl.load(feed + tl.maximum(rows, 0), mask=fed)
    tl.store(input_ids + offs, tokens, mask=fed)


def feed_tokens(input_ids: torch.Tensor, feed_rows: torch.Tensor, feed: torch.Tensor) -> None:
    """In place: input_ids[i] = feed[feed_rows[i]] wherever feed_rows[i] >= 0. input_ids / feed_rows [T]
    int64 on one device, feed [>= max row + 1] int64 (the previous step's sampled tokens first)."""
    if input_ids.shape != feed_rows.shape or input_ids.dim() != 1:
        raise ValueError(f"feed_tokens: input_ids and feed_rows must be [T], got {tuple(input_ids.shape)} and "
                         f"{tuple(feed_rows.shape)}")
    num_tokens = input_ids.shape[0]
    if num_tokens:
        _feed_tokens_kernel[(triton.cdiv(num_tokens, BLOCK),)](
            input_ids, feed_rows, feed, num_tokens, BLOCK=BLOCK, num_warps=4, **pdl_launch(input_ids.device))
