"""Qwen3 (dense): Llama's layout plus an RMSNorm over each q and k head before rotary.

Everything else (GQA, SwiGLU MLP, tied or untied embeddings, rope handling) is shared with
`models/llama.py`; only the attention's q/k transform and its two checkpoint tensors differ.
"""
from __future__ import annotations

import torch

from spmd_engine.models.layers.norm import RMSNorm
from spmd_engine.models.llama import LlamaAttention, LlamaForCausalLM
from spmd_engine.models.model_config import ModelShape
from spmd_engine.models.parallel import TensorParallel


class Qwen3Attention(LlamaAttention):
    def __init__(self, shape: ModelShape, tp: TensorParallel, backend: str, window: int = 0) -> None:
        super().__init__(shape, tp, backend, window=window)
        self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
        self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)  # the same eps as q_norm (one kernel for both)

    def transform_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if q.is_cuda and q.dim() == 3 and k.dim() == 3 and q.stride(-1) == 1 and k.stride(-1) == 1:
            from spmd_engine.kernels.rms_norm import rms_norm_pair  # both norms in one launch, the same bits

            return rms_norm_pair(q, self.q_norm.weight, k, self.k_norm.weight, self.q_norm.eps)
        return self.q_norm(q), self.k_norm(k)

    def qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention

    def layer_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        d = self.shape.head_dim
        return {**super().layer_checkpoint_shapes(), "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
