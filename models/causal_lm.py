"""CausalLM: the model API the engine calls, shared by every architecture.

Subclasses build `self.model` (HF's parameter names below it) and `self.lm_head`, say which HF
checkpoint projections are packed into one parameter, and list the checkpoint tensors they expect;
binding the KV cache and mapping checkpoint names are the same for all of them.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from spmd_engine.models.attention_metadata import AttentionMetadata
from spmd_engine.models.layers.attention import Attention
from spmd_engine.models.layers.embedding import ParallelLMHead
from spmd_engine.models.layers.rotary import RotaryEmbedding
from spmd_engine.models.model_config import ModelShape
from spmd_engine.models.parallel import TensorParallel

ShardId = str | int | None


class CausalLM(nn.Module):
    """Decoder-only LM: token ids -> hidden states -> logits on tensor-parallel rank 0."""

    # HF checkpoint module name -> (our packed module name, shard id), e.g. q_proj -> (qkv_proj, "q")
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {}

    shape: ModelShape
    tp: TensorParallel
    # (input_ids, positions, attn) -> hidden; HF's `model.` parameter prefix. It has `embed`, `layers`
    # (decoder layers with `before_attention` / `after_attention` halves and `self_attn.attn`) and `norm`:
    # its forward is embed, then per layer before_attention, attention, after_attention, then norm
    model: nn.Module
    lm_head: ParallelLMHead

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, attn)

    # --- the same forward in pieces cut at attention (spmd_engine/executor/piecewise_graphs.py) ---------
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Token embeddings and the per-token rotary tables every layer reads."""
        return self.model.embed(input_ids, positions)

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.model.layers)

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's output (MLP output + residual stream) -> final hidden states."""
        return self.model.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] -> float32 logits [N, vocab] on tp rank 0, None on the other ranks."""
        return self.lm_head.compute_logits(hidden)

    def tabulate_rotary(self, max_len: int, dtype: torch.dtype) -> None:
        """Every rotary embedding keeps (cos, sin) of positions [0, max_len) in `dtype` (the CUDA runner:
        a step gathers them instead of computing them; see RotaryEmbedding.tabulate)."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.tabulate(max_len, dtype)

    def attention_layers(self) -> list[Attention]:
        return [module for module in self.modules() if isinstance(module, Attention)]

    def bind_kv_cache(self, caches: list[tuple[torch.Tensor | None, torch.Tensor | None]]) -> None:
        """Give layer i its (k_cache, v_cache); (None, None) unbinds."""
        layers = self.attention_layers()
        if len(caches) != len(layers):
            raise ValueError(f"got {len(caches)} KV caches for {len(layers)} attention layers")
        for layer, (k_cache, v_cache) in zip(layers, caches):
            layer.k_cache, layer.v_cache = k_cache, v_cache

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a full HF checkpoint of this model holds (unsharded shapes)."""
        raise NotImplementedError

    def checkpoint_to_parameter(self, name: str) -> tuple[str, ShardId]:
        """HF checkpoint tensor name -> (our parameter name, shard id or None if not packed)."""
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.packed_modules:
                packed, shard_id = self.packed_modules[part]
                return ".".join(parts[:i] + [packed] + parts[i + 1:]), shard_id
        return name, None
