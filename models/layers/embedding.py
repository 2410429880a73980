"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded to a multiple of the tensor-parallel size and split into equal row
ranges; padding rows are zero. The embedding looks up only its own range and all-reduces; the
LM head gathers every rank's logits onto rank 0, the only rank that samples.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spmd_engine.models.layers.linear import SmallBatchSwitch, linear
from spmd_engine.models.layers.weight_loading import copy_checked, new_parameter
from spmd_engine.models.parallel import TensorParallel


class _VocabShardedWeight(nn.Module):
    """A [vocab, hidden] weight of which this rank holds rows [vocab_start, vocab_start + rows)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel,
                 shared_weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.world_size)
        self.padded_vocab_size = self.rows_per_rank * tp.world_size
        self.vocab_start = tp.rank * self.rows_per_rank
        self.num_real_rows = max(0, min(self.rows_per_rank, vocab_size - self.vocab_start))
        if shared_weight is not None:
            self.weight = shared_weight
        else:
            self.weight = new_parameter(self.rows_per_rank, hidden_size, loader=self.load_rows)

    def load_rows(self, param: nn.Parameter, full: torch.Tensor) -> None:
        if full.shape[0] != self.vocab_size:
            raise ValueError(f"vocabulary weight has {full.shape[0]} rows, "
                             f"expected vocab_size={self.vocab_size}")
        real = self.num_real_rows
        copy_checked(param.data[:real], full.narrow(0, min(self.vocab_start, self.vocab_size), real),
                     "vocabulary weight")
        with torch.no_grad():
            param.data[real:].zero_()


class VocabParallelEmbedding(_VocabShardedWeight):
    """token ids [T] -> embeddings [T, hidden]."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(local.masked_fill(~in_shard, 0), self.weight)
        out.masked_fill_(~in_shard[:, None], 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(SmallBatchSwitch, _VocabShardedWeight):
    """hidden [N, hidden] -> float32 logits [N, vocab] on tensor-parallel rank 0 (None elsewhere).

    On CUDA the matmul writes float32 directly: bf16 logits (8 significant bits) tie often, and a
    tie decided by a rounding makes greedy tokens depend on the rank count and on kernel choice.
    A small batch takes the GEMV with float32 out (`linear`), unless switched off.
    `tied_to`: share the embedding's weight (tie_word_embeddings); it has the same shape and shard.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel,
                 tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__(vocab_size, hidden_size, tp, tied_to.weight if tied_to is not None else None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16):
            logits = linear(hidden, self.weight, out_dtype=torch.float32, small_batch_gemv=self.small_batch_gemv)
        else:  # CPU has no float32-output matmul; upcasting the whole vocabulary matrix costs too much
            logits = F.linear(hidden, self.weight)
        logits = self.tp.gather_to_first(logits, dim=-1)
        if logits is None:
            return None
        return logits[:, : self.vocab_size].float()
