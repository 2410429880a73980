"""Triton: a packed token bitmask applied to logits rows in place (structured outputs).

Bit j of word w of a mask row allows token 32 * w + j (xgrammar's layout: int32 words, least significant bit
first); a disallowed token's logit becomes -inf. Mask row i belongs to logits row `rows[i]`, so a step whose
constrained requests are a few of its rows reads and writes only those. One program per (mask row, block of
BLOCK tokens); columns past the mask's words (a vocabulary wider than the mask) are left as they are.
`reference.apply_token_bitmask_reference` is the same in torch (the CPU path and the tests' oracle).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.pdl import pdl_launch, pdl_prologue

BLOCK = 1024  # tokens per program (32 mask words)


@triton.jit
def _token_bitmask_kernel(logits, mask, rows, vocab, words, stride_logits, stride_mask, BLOCK: tl.constexpr,
                          USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows + i).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = (cols < vocab) & (cols < words * 32)
    word = tl.load(mask + i * stride_mask + cols // 32, mask=in_vocab, other=-1)
    allowed = ((word >> (cols % 32)) & 1) != 0
    tl.store(logits + row * stride_logits + cols, tl.full([BLOCK], float("-inf"), logits.dtype.element_ty),
             mask=in_vocab & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (last dim contiguous), mask [M, W] int32, rows [M] int (logits row of each mask row),
    all on one device: logits[rows[i], t] = -inf where bit t of mask[i] is 0 (t < min(V, 32 W)). In place."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"apply_token_bitmask: logits must be [N, V] with a contiguous last dim, "
                         f"got {tuple(logits.shape)}")
    if mask.dim() != 2 or mask.dtype != torch.int32 or mask.stride(1) != 1:
        raise ValueError(f"apply_token_bitmask: mask must be int32 [M, W], got {mask.dtype} {tuple(mask.shape)}")
    if rows.shape != (mask.shape[0],):
        raise ValueError(f"apply_token_bitmask: rows must be [{mask.shape[0]}], got {tuple(rows.shape)}")
    vocab, words = logits.shape[1], mask.shape[1]
    if mask.shape[0]:
        grid = (mask.shape[0], triton.cdiv(min(vocab, 32 * words), BLOCK))
        _token_bitmask_kernel[grid](logits, mask, rows, vocab, words, logits.stride(0), mask.stride(0), BLOCK=BLOCK,
                                    num_warps=4, **pdl_launch(logits.device))
    return logits
