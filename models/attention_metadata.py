"""The batch layout every attention layer needs for one step.

It lives on the models side so that `models/` never imports `spmd_engine`: the engine builds
one of these per step (from the rank-0 plan) and passes it explicitly into `model.forward`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Flattened (varlen) batch: T tokens from B sequences, KV read through block tables.

    Token t of sequence b sits at position `seq_lens[b] - query_len[b] + i` and attends to every
    key at a position <= its own (causal mask aligned lower-right, so a cached prefix is seen).
    """

    slot_mapping: torch.Tensor  # [T] int64: KV-cache slot (block * block_size + offset); -1 = padding, not stored
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: query offsets into the T tokens
    seq_lens: torch.Tensor  # [B] int32: keys per sequence after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32: KV block ids per sequence (unused tail arbitrary)
    max_query_len: int  # max over B of query lengths (host int, no device sync needed)
    max_seq_len: int  # max over B of seq_lens (host int)
    block_size: int
    is_decode: bool  # every sequence has query length 1 (enables the decode kernel / CUDA graphs)
    # the first num_decode_seqs sequences have query length 1 (their tokens are the first ones): the
    # Triton path runs them through the split-KV decode kernel, the rest through the prefill kernel
    num_decode_seqs: int = 0
    # the Triton path's per-step launch plans (kernels/mixed_attention.py), keyed by the layer tensors'
    # geometry: built by the first layer of a step, reused by the others (host time per layer)
    launch_plans: dict = field(default_factory=dict, repr=False, compare=False)
    # [T, Hq * D] (this rank's heads): where the fused q/k norm + rotary + KV store writes q, so the piecewise
    # graphs get q in their static buffer without a copy; None: a new tensor
    q_out: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_seqs  # one token each

    @property
    def num_decode_rows(self) -> int:
        """The sequences the Triton path sends through the decode kernel (all of them in a decode step)."""
        return self.num_seqs if self.is_decode else self.num_decode_seqs
