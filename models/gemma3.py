"""Gemma 3 (text, `Gemma3ForCausalLM`): Llama's GQA attention and gated MLP with Gemma's changes.

- RMSNorm scales by (1 + w) and rounds once, after the weight (`GemmaRMSNorm`); every decoder layer norms
  the attention and MLP inputs and outputs (four norms), and q/k get a per-head norm before rotary.
- Embeddings are scaled by sqrt(hidden_size) rounded to the model dtype; the MLP is GeLU-tanh gated.
- The attention scale is `query_pre_attn_scalar` ** -0.5.
- Layers are sliding (local) or full (global) by `layer_types` (ModelShape.layer_windows); local layers
  rotate with their own rope base (`rope_local_base_freq`, ModelShape.local_rope).
- An optional final logit soft-cap: logits = c * tanh(logits / c).

Module names follow HF's, so the checkpoint maps as Llama's does (q/k/v and gate/up packed).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spmd_engine.models.attention_metadata import AttentionMetadata
from spmd_engine.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from spmd_engine.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from spmd_engine.models.layers.rotary import RotaryEmbedding
from spmd_engine.models.layers.weight_loading import new_parameter
from spmd_engine.models.llama import CosSin, LlamaAttention, LlamaForCausalLM, LlamaModel
from spmd_engine.models.model_config import ModelShape
from spmd_engine.models.parallel import TensorParallel


class GemmaRMSNorm(nn.Module):
    """y = x / rms(x) * (1 + w) in float32, rounded once to x's dtype (HF's Gemma3RMSNorm); with `residual`:
    (norm(x + residual), x + residual), as models/layers/norm.RMSNorm."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter(hidden_size)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            return self._normalize(x), x
        return self._normalize(x)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(LlamaAttention):
    """Llama's attention with a Gemma norm over each q and k head (not the fused kernels' Llama-style norm:
    `qk_norm` stays None, so every backend runs `transform_qk`, then rotary and the store)."""

    def __init__(self, shape: ModelShape, tp: TensorParallel, backend: str, window: int = 0) -> None:
        super().__init__(shape, tp, backend, window=window)
        self.q_norm = GemmaRMSNorm(shape.head_dim, shape.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(shape.head_dim, shape.rms_norm_eps)

    def transform_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Gemma3MLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), intermediate features split across ranks."""

    def __init__(self, shape: ModelShape, tp: TensorParallel) -> None:
        super().__init__()
        hidden, inter = shape.hidden_size, shape.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], tp, bias=False)
        self.down_proj = RowParallelLinear(inter, hidden, tp, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then + post_ff_norm(mlp(pre_ff_norm(.))). Like Llama's layer it
    returns (this layer's MLP output, the residual stream before it) and the next norm adds them, so the
    piecewise graphs cut it the same way. `cos_sin` holds both ropes side by side (`Gemma3Model.embed`)."""

    def __init__(self, shape: ModelShape, tp: TensorParallel, backend: str, window: int) -> None:
        super().__init__()
        h, eps = shape.hidden_size, shape.rms_norm_eps
        self.local = bool(window) and shape.local_rope is not None
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Gemma3Attention(shape, tp, backend, window=window)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = Gemma3MLP(shape, tp)

    def _rope(self, cos_sin: CosSin) -> CosSin:
        """This layer's (cos, sin) [T, D/2]: the global rope's columns first, the local one's after them."""
        cos, sin = cos_sin
        half = self.self_attn.head_dim // 2
        if cos.shape[-1] == half:  # one rope for every layer
            return cos, sin
        cols = slice(half, 2 * half) if self.local else slice(0, half)
        return cos[:, cols], sin[:, cols]

    def _input_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm(hidden, residual)

    def before_attention(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin: CosSin,
                         attn: AttentionMetadata
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        hidden, residual = self._input_norm(hidden, residual)
        q, k, v = self.self_attn.project(hidden, self._rope(cos_sin), attn)
        return q, k, v, residual

    def after_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.post_attention_layernorm(self.self_attn.o_proj(attn_out))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin: CosSin,
                attn: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self._input_norm(hidden, residual)
        return self.after_attention(self.self_attn(hidden, self._rope(cos_sin), attn), residual)


class Gemma3Model(nn.Module):
    """Scaled embedding, the decoder layers, the final norm (HF's `model.` prefix)."""

    def __init__(self, shape: ModelShape, tp: TensorParallel, backend: str) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(shape.vocab_size, shape.hidden_size, tp)
        self.embed_scale = shape.hidden_size**0.5
        self.rotary_emb = RotaryEmbedding(shape.head_dim, shape.max_position_embeddings, shape.rope)
        self.rotary_emb_local = None
        if shape.local_rope is not None and any(shape.layer_windows):
            self.rotary_emb_local = RotaryEmbedding(shape.head_dim, shape.max_position_embeddings, shape.local_rope)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(shape, tp, backend, shape.window(i)) for i in range(shape.num_layers)
        )
        self.norm = GemmaRMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, CosSin]:
        """Scaled token embeddings (the scale rounded to their dtype first, as HF) and the rotary (cos, sin):
        [T, D/2], or [T, D] with the local rope's columns after the global one's."""
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * float(torch.tensor(self.embed_scale, dtype=hidden.dtype))
        cos, sin = self.rotary_emb.rows(positions, hidden.dtype)
        if self.rotary_emb_local is not None:
            cos_local, sin_local = self.rotary_emb_local.rows(positions, hidden.dtype)
            cos, sin = torch.cat([cos, cos_local], dim=-1), torch.cat([sin, sin_local], dim=-1)
        return hidden, (cos, sin)

    forward = LlamaModel.forward  # embed, the layers with the fused residual adds, the final norm


class Gemma3ForCausalLM(LlamaForCausalLM):
    """`model` + the tied (or untied) `lm_head`, with the optional final soft-cap."""

    hidden_acts = ("gelu_pytorch_tanh", "gelu_tanh")

    def __init__(self, shape: ModelShape, tp: TensorParallel, attention_backend: str = "torch") -> None:
        nn.Module.__init__(self)
        self.shape, self.tp = shape, tp
        self.model = Gemma3Model(shape, tp, attention_backend)
        tied_to = self.model.embed_tokens if shape.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(shape.vocab_size, shape.hidden_size, tp, tied_to=tied_to)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.shape.final_logit_softcapping
        if logits is None or not cap:
            return logits
        return torch.tanh(logits / cap) * cap

    def layer_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        h, d = self.shape.hidden_size, self.shape.head_dim
        return {**super().layer_checkpoint_shapes(), "pre_feedforward_layernorm.weight": (h,),
                "post_feedforward_layernorm.weight": (h,), "self_attn.q_norm.weight": (d,),
                "self_attn.k_norm.weight": (d,)}
