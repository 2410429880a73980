"""Rotary position embedding (rotate-half / NeoX layout, as HF Llama and Qwen3) for every rope type
in `RopeConfig`: default, linear, llama3, yarn (with its attention factor on cos/sin) and dynamic.

cos/sin are computed from the positions on the fly (float32, like HF) instead of read from a table:
no max-length table to size, bitwise the same arithmetic as HF, and still CUDA-graph safe.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from spmd_engine.models.layers.rope_config import RopeConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """1 / theta^(2i/dim), i = 0 .. dim/2 - 1, in float32 on the CPU (as HF computes it)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between."""
    inv_freq = _base_inv_freq(rope.theta, dim)
    old_len = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / rope.low_freq_factor, old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_attention_factor(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return float(rope.attention_factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
    return mscale(rope.factor)


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: interpolate (divide by factor) the low frequencies, extrapolate the high ones, with a
    linear ramp over the dimensions whose rotation count at the pretraining length is in between."""

    def dim_for_rotations(rotations: float) -> float:
        original = rope.original_max_position_embeddings
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_for_rotations(rope.beta_fast), dim_for_rotations(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    wavelength_scale = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated, interpolated = 1.0 / wavelength_scale, 1.0 / (rope.factor * wavelength_scale)
    keep_extrapolated = 1 - ramp
    return interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated


def _ntk_inv_freq(rope: RopeConfig, dim: int, max_position_embeddings: int, seq_len: float) -> torch.Tensor:
    """Dynamic NTK: a larger base for a context of `seq_len` > max_position_embeddings."""
    ratio = rope.factor * seq_len / max_position_embeddings - (rope.factor - 1)
    return _base_inv_freq(rope.theta * ratio ** (dim / (dim - 2)), dim)


def inverse_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float32 on CPU, attention factor) for every type but `dynamic`'s long range."""
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, dim), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, dim), _yarn_attention_factor(rope)
    if rope.rope_type == "linear":
        return _base_inv_freq(rope.theta, dim) / rope.factor, 1.0
    return _base_inv_freq(rope.theta, dim), 1.0  # default, and dynamic below max_position_embeddings


class RotaryEmbedding(nn.Module):
    """positions [T] -> (cos, sin) [T, head_dim/2] float32, attention factor already applied.

    `dynamic` NTK: HF rescales the base from the longest position of the *current batch*, which a
    paged KV cache cannot follow (cached keys keep their old rotation). Here a token at a position
    < max_position_embeddings is rotated exactly as HF rotates any sequence that fits in
    max_position_embeddings (the plain base); a token at or beyond it uses the static vLLM-style
    base computed for a context of max_position_embeddings * factor.
    """

    def __init__(self, head_dim: int, max_position_embeddings: int, rope: RopeConfig) -> None:
        super().__init__()
        device = torch.get_default_device()
        inv_freq, self.attention_factor = inverse_frequencies(rope, head_dim)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.long_from: int | None = None
        if rope.rope_type == "dynamic":
            self.long_from = max_position_embeddings
            long = _ntk_inv_freq(rope, head_dim, max_position_embeddings, max_position_embeddings * rope.factor)
            self.register_buffer("inv_freq_long", long.to(device), persistent=False)
        self.table: torch.Tensor | None = None  # [max_len, 2 * half]: cos | sin of every position, `tabulate`

    def tabulate(self, max_len: int, dtype: torch.dtype) -> None:
        """Keep (cos, sin) of positions [0, max_len) in `dtype`, made by `forward` itself (the same bits),
        so that a step gathers its rows instead of computing them in ~8 elementwise launches (~15 µs of
        a CUDA decode step). Positions must then stay below max_len (the engine's max_model_len). cos and
        sin share one row per position, so one gather serves both (two strided views: every rotary kernel
        takes a row stride), one launch fewer a step."""
        cos, sin = self.forward(torch.arange(max_len, device=self.inv_freq.device))
        self.table = torch.cat([cos.to(dtype), sin.to(dtype)], dim=-1)

    @property
    def tables(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) [max_len, half] of every tabulated position (views of `table`), or None."""
        if self.table is None:
            return None
        half = self.table.shape[-1] // 2
        return self.table[:, :half], self.table[:, half:]

    def rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, head_dim/2] of `positions` in `dtype`: from the tables when they hold it."""
        if self.table is not None and self.table.dtype == dtype:
            rows = self.table.index_select(0, positions)
            half = rows.shape[-1] // 2
            return rows[:, :half], rows[:, half:]
        cos, sin = self.forward(positions)
        return cos.to(dtype), sin.to(dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq[None, :]
        if self.long_from is not None:
            is_long = (positions >= self.long_from)[:, None]
            inv_freq = torch.where(is_long, self.inv_freq_long[None, :], inv_freq)
        angles = positions[:, None].float() * inv_freq
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by the angles of its tokens (rotate-half layout); returns x's dtype."""
    if x.is_cuda and x.stride(-1) == 1 and cos.stride() == sin.stride() and cos.stride(-1) == 1:
        from spmd_engine.kernels.rotary import apply_rotary as rotary_kernel  # one launch instead of ~7

        return rotary_kernel(x, cos, sin)
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
