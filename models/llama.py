"""Llama (Llama 3.x, SmolLM2, ...): pre-norm decoder layers of GQA attention with rotary
positions and a SwiGLU MLP; optional attention/MLP biases as HF's LlamaConfig allows.

Module names below `model.` and `lm_head` follow HF's, so checkpoint names map one to one except
q/k/v (packed into qkv_proj) and gate/up (packed into gate_up_proj).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from spmd_engine.models.attention_metadata import AttentionMetadata
from spmd_engine.models.causal_lm import CausalLM
from spmd_engine.models.layers.attention import Attention
from spmd_engine.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from spmd_engine.models.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from spmd_engine.models.layers.norm import RMSNorm
from spmd_engine.models.layers.rotary import RotaryEmbedding, apply_rotary
from spmd_engine.models.model_config import ModelShape
from spmd_engine.models.parallel import TensorParallel

CosSin = tuple[torch.Tensor, torch.Tensor]


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), intermediate features split across ranks. down_proj applies the
    activation itself (`gated`): at small batch its GEMV does it while loading, no launch of its own."""

    def __init__(self, shape: ModelShape, tp: TensorParallel) -> None:
        super().__init__()
        hidden, inter = shape.hidden_size, shape.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], tp, bias=shape.mlp_bias)
        self.down_proj = RowParallelLinear(inter, hidden, tp, bias=shape.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), gated=True)


class LlamaAttention(nn.Module):
    """qkv projection -> (per-head q/k transform) -> rotary -> paged attention -> output projection; the
    decoder layer calls the parts (`project`, `attn.attend`, `o_proj`) so the pieces can be graphed apart."""

    def __init__(self, shape: ModelShape, tp: TensorParallel, backend: str, window: int = 0) -> None:
        super().__init__()
        d = shape.head_dim
        self.head_dim = d
        self.qkv_proj = QKVParallelLinear(shape.hidden_size, d, shape.num_heads, shape.num_kv_heads, tp,
                                          bias=shape.attention_bias or shape.qkv_bias)
        self.o_proj = RowParallelLinear(shape.num_heads * d, shape.hidden_size, tp, bias=shape.attention_bias)
        scale = shape.query_pre_attn_scalar ** -0.5 if shape.query_pre_attn_scalar else d**-0.5
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d, scale, backend, window=window)

    def transform_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook on q [T, Hq, D] and k [T, Hkv, D] before rotary; Llama has none."""
        return q, k

    def qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """`transform_qk` as (q weight, k weight, eps) of a per-head RMSNorm, for the fused kernel; None: none."""
        return None

    def forward(self, hidden: torch.Tensor, cos_sin: CosSin, attn: AttentionMetadata) -> torch.Tensor:
        """hidden [T, hidden] -> attention output [T, Hq * D] (before o_proj). A decode step on the Triton path
        goes from the qkv projection's output to attention's in one launch (the q/k transform, rotary and K/V
        store inside the decode kernel); otherwise `project`, then `attn.attend`."""
        q, k, v = self._qkv(hidden)
        if self._transform_fuses():
            out = self.attn.rotate_store_attend(q, k, v, cos_sin, attn, self.qk_norm())
            if out is not None:
                return out
        return self.attn.attend(*self._rotate_store(q, k, v, cos_sin, attn), attn)

    def project(self, hidden: torch.Tensor, cos_sin: CosSin, attn: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """qkv projection, q/k transform, rotary, K/V stored into the cache -> (q, k, v), each [T, heads * D].
        On the fused Triton path (a cache bound) k and v are only in the cache: (q, None, None)."""
        return self._rotate_store(*self._qkv(hidden), cos_sin, attn)

    def _qkv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The qkv projection as views: q [T, Hq, D], k [T, Hkv, D], v [T, Hkv * D]."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        return q.reshape(num_tokens, -1, self.head_dim), k.reshape(num_tokens, -1, self.head_dim), v

    def _transform_fuses(self) -> bool:
        """Whether the Triton kernels can do this layer's q/k transform (a per-head norm, or none)."""
        return self.qk_norm() is not None or type(self).transform_qk is LlamaAttention.transform_qk

    def _rotate_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: CosSin,
                      attn: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        num_tokens = q.shape[0]
        if self._transform_fuses():
            fused = self.attn.rotate_and_store(q, k, v, cos_sin, attn, self.qk_norm())
            if fused is not None:
                return fused.reshape(num_tokens, -1), None, None
        q, k = self.transform_qk(q, k)
        q, k = apply_rotary(q, *cos_sin).reshape(num_tokens, -1), apply_rotary(k, *cos_sin).reshape(num_tokens, -1)
        self.attn.store(k, v, attn)
        return q, k, v


class LlamaDecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)); the residual adds are fused into the next norm."""

    def __init__(self, shape: ModelShape, tp: TensorParallel, backend: str, attention_cls: type[LlamaAttention],
                 window: int = 0, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = attention_cls(shape, tp, backend, window=window)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(shape, tp)  # `mlp`: another feed-forward (an MoE block)

    def before_attention(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin: CosSin,
                         attn: AttentionMetadata
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """Residual add + norm, q/k/v with K/V stored -> (q, k, v, residual). Only `attn.slot_mapping` is
        read, so this half runs inside the piecewise CUDA graphs."""
        hidden, residual = self._input_norm(hidden, residual)
        q, k, v = self.self_attn.project(hidden, cos_sin, attn)
        return q, k, v, residual

    def _input_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm(hidden, residual)

    def after_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, residual add + norm, MLP -> (this layer's MLP output, the residual stream before it)."""
        hidden, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn_out), residual)
        return self.mlp(hidden), residual

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin: CosSin,
                attn: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); their sum is the output. The
        same parts as before_attention, attention, after_attention (the piecewise graphs' split), but a decode
        step may take the projection to attention in one launch (`LlamaAttention.forward`)."""
        hidden, residual = self._input_norm(hidden, residual)
        return self.after_attention(self.self_attn(hidden, cos_sin, attn), residual)


class LlamaModel(nn.Module):
    """Embedding, the decoder layers, the final norm (HF's `model.` prefix)."""

    def __init__(self, shape: ModelShape, tp: TensorParallel, backend: str, attention_cls: type[LlamaAttention],
                 make_mlp: Callable[[int], nn.Module | None] | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(shape.vocab_size, shape.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(shape.head_dim, shape.max_position_embeddings, shape.rope)
        self.layers = nn.ModuleList(  # make_mlp(i): layer i's feed-forward; None (or no make_mlp): LlamaMLP
            LlamaDecoderLayer(shape, tp, backend, attention_cls, window=shape.window(i),
                              mlp=make_mlp(i) if make_mlp else None)
            for i in range(shape.num_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, CosSin]:
        """Token embeddings and the rotary (cos, sin) every layer uses, in the activation dtype."""
        hidden = self.embed_tokens(input_ids)
        return hidden, self.rotary_emb.rows(positions, hidden.dtype)  # once here, not in every layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        hidden, cos_sin = self.embed(input_ids, positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos_sin, attn)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    """`model` (embedding, layers, norm) + `lm_head`, sharded over `tp`."""

    attention_cls: type[LlamaAttention] = LlamaAttention
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, shape: ModelShape, tp: TensorParallel, attention_backend: str = "torch") -> None:
        super().__init__()
        self.shape, self.tp = shape, tp
        self.model = LlamaModel(shape, tp, attention_backend, self.attention_cls, make_mlp=self.make_mlp)
        tied_to = self.model.embed_tokens if shape.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(shape.vocab_size, shape.hidden_size, tp, tied_to=tied_to)

    def make_mlp(self, layer: int) -> nn.Module | None:
        """Hook: decoder layer `layer`'s feed-forward module; None: the dense LlamaMLP."""
        return None

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        s = self.shape
        shapes = {"model.embed_tokens.weight": (s.vocab_size, s.hidden_size), "model.norm.weight": (s.hidden_size,)}
        for i in range(s.num_layers):
            shapes.update({f"model.layers.{i}.{name}": shape for name, shape in self.layer_checkpoint_shapes().items()})
        if not s.tie_word_embeddings:
            shapes["lm_head.weight"] = (s.vocab_size, s.hidden_size)
        return shapes

    def layer_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """One decoder layer's checkpoint tensors, names relative to `model.layers.{i}.`."""
        s = self.shape
        h, q, kv, inter = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
        shapes = {
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
            "mlp.down_proj.weight": (h, inter),
        }
        if s.attention_bias or s.qkv_bias:
            shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                           "self_attn.v_proj.bias": (kv,)})
        if s.attention_bias:
            shapes["self_attn.o_proj.bias"] = (h,)
        if s.mlp_bias:
            shapes.update({"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,), "mlp.down_proj.bias": (h,)})
        return shapes
