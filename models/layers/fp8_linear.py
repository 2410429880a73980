"""FP8 weights (W8A8) for the tensor-parallel linear layers: `quantization=fp8`.

Two sources, one stored form:
- an FP8 checkpoint (`quantization_config: {quant_method: fp8, weight_block_size: [bn, bk],
  activation_scheme: dynamic}`, Qwen's FP8 releases): float8_e4m3fn weights and one float32
  `weight_scale_inv` per bn x bk block (w ~= q * scale);
- a 16/32-bit checkpoint, quantized at load with `ONLINE_RECIPE` (per output channel by default).

Each quantized layer keeps `weight` as float8_e4m3fn [N, K] (this rank's rows / columns) and
`weight_scale_inv` as float32 [N, ceil(K / block_k)]: block scales are expanded to one per weight row at
load, so a rank's rows may start anywhere inside a block (packed q | k | v, replicated KV heads) and the
scales shard exactly as the rows do. Row-parallel layers split K, so a rank's K must hold whole blocks.
Activations are quantized per token and group of `group` columns (the checkpoint's block_k; online: the
recipe's; halved until it divides a rank's K, so that every tensor-parallel size quantizes alike) at every
matmul (`kernels/fp8_matmul.py`). Embeddings, norms and the LM head stay 16-bit.

A 16-bit tensor arriving for a layer of an FP8 checkpoint (an in-place weight update) is quantized with
the checkpoint's own recipe, its scales written alongside.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from spmd_engine.kernels.reference import fp8_quantize_weight_reference
from spmd_engine.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from spmd_engine.models.layers.weight_loading import copy_checked, replicated_loader

QUANTIZATIONS = ("auto", "fp8", "none")
FP8 = torch.float8_e4m3fn
WHOLE_ROW = 0  # a block_k (or group) of 0: the whole row (K) at once


@dataclass(frozen=True)
class Fp8Scheme:
    """How weights and activations are scaled: weights per block_n x block_k block of the FULL tensor
    (block_k 0: whole rows), activations per token and `group` columns (0: per token)."""

    block_n: int
    block_k: int
    group: int
    from_checkpoint: bool  # the checkpoint holds fp8 weights and `weight_scale_inv`

    def describe(self) -> str:
        weights = "per output channel" if self.block_n == 1 and self.block_k == WHOLE_ROW else \
            f"{self.block_n}x{self.block_k} blocks"
        acts = "per token" if self.group == WHOLE_ROW else f"per token and {self.group} columns"
        source = "checkpoint" if self.from_checkpoint else "quantized at load"
        return f"fp8 e4m3 weights ({weights}, {source}), activations {acts}"


# quantization=fp8 on a 16-bit checkpoint: weight scales per output channel, activation scales per token and
# 128 columns (docs/PERFORMANCE.md, FP8 weights accuracy: launch/bench/fp8_weights_accuracy.py)
ONLINE_RECIPE = Fp8Scheme(block_n=1, block_k=WHOLE_ROW, group=128, from_checkpoint=False)


def resolve_quantization(quantization: str, hf_config: dict[str, Any]) -> Fp8Scheme | None:
    """`quantization` (auto | fp8 | none) and the checkpoint's quantization_config -> the scheme, or None
    for 16-bit weights. ValueError (one line) for a combination that cannot load."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {'|'.join(QUANTIZATIONS)}, got {quantization!r}")
    qc = hf_config.get("quantization_config") or {}
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method is None:
        return ONLINE_RECIPE if quantization == "fp8" else None
    if method != "fp8":
        raise ValueError(f"model quantization_config.quant_method={method!r} is not supported (fp8 only)")
    if quantization == "none":
        raise ValueError("quantization=none cannot load this FP8 checkpoint (quantization_config.quant_method=fp8); "
                         "use quantization=auto or fp8")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"model quantization_config.activation_scheme={qc.get('activation_scheme')!r} is not "
                         "supported (dynamic only)")
    block = qc.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b >= 1
                                                                        for b in block)):
        raise ValueError(f"model quantization_config.weight_block_size must be [rows, cols] (e.g. [128, 128]), "
                         f"got {block!r}")
    return Fp8Scheme(block_n=block[0], block_k=block[1], group=block[1], from_checkpoint=True)


def _blocks(full: int, block: int) -> int:
    return -(-full // block) if block else 1


def _group_for(k: int, group: int) -> int:
    """The activation group of a layer with K input columns (per rank): the largest power of two <= `group`
    (>= 32, an fp8 MMA's K) that divides K, so tensor-parallel shards of K keep whole groups; else (or group 0)
    the whole row."""
    size = 1 << (group.bit_length() - 1) if group else 0
    while size >= 32 and k % size:
        size //= 2
    return size if size >= 32 else k


class Fp8Layer:
    """What `quantize_linear_layers` adds to a layer: its scheme and the matmul on fp8 weights."""

    @staticmethod
    def convert(layer: nn.Module, scheme: Fp8Scheme) -> None:
        weight = layer.weight
        n, k = weight.shape
        row_parallel = isinstance(layer, RowParallelLinear)
        tp = layer.tp
        full_k = k * tp.world_size if row_parallel else k
        block_k = scheme.block_k or full_k
        if row_parallel and tp.world_size > 1 and block_k < full_k and k % block_k:
            raise ValueError(f"quantization=fp8: a row-parallel layer's {k} input features per rank are not a "
                             f"multiple of the weight block {block_k}; use a tensor_parallel_size that keeps "
                             f"whole blocks")
        group = _group_for(k, scheme.group if scheme.group else 0)
        if block_k < full_k and block_k % group and group != k:
            raise ValueError(f"quantization=fp8: activation group {group} does not divide weight block {block_k}")
        original = weight.weight_loader
        layer.weight = nn.Parameter(torch.empty(n, k, dtype=FP8, device=weight.device), requires_grad=False)
        layer.weight_scale_inv = nn.Parameter(
            torch.ones(n, _blocks(k, block_k) if block_k < full_k else 1, dtype=torch.float32, device=weight.device),
            requires_grad=False)
        layer.fp8_scheme = scheme
        layer.fp8_block_k = block_k if block_k < full_k else k
        layer.fp8_group = group
        scale_loader = _scale_loader(layer, original, scheme, row_parallel, block_k < full_k)
        layer.weight.weight_loader = _weight_loader(layer, original, scale_loader, scheme, full_k)
        layer.weight_scale_inv.weight_loader = scale_loader
        layer.matmul = _fp8_matmul.__get__(layer)


def _scale_loader(layer: nn.Module, original, scheme: Fp8Scheme, row_parallel: bool, blocked_k: bool):
    """Loads a FULL block-scale tensor [ceil(N / bn), ceil(K / bk)] (one checkpoint projection): rows expanded
    to one per weight row, then this rank's rows (columns: its K blocks) as the weight's own loader picks them."""
    def load(param: nn.Parameter, full: torch.Tensor, *shard) -> None:
        rows = full.float().repeat_interleave(scheme.block_n, 0)
        if row_parallel:
            rows = rows[: param.shape[0]]
            if blocked_k:
                cols = param.shape[1]
                copy_checked(param.data, rows.narrow(1, layer.tp.rank * cols, cols), "row-parallel weight scale")
            else:
                replicated_loader(param, rows)
            return
        total = _full_rows(layer, shard)
        original(param, rows[:total], *shard)
    return load


def _full_rows(layer: nn.Module, shard: tuple) -> int:
    """Rows of the FULL checkpoint projection `shard` of a column-parallel layer."""
    if not shard:
        return layer.output_size_per_rank * layer.tp.world_size
    shard_id = shard[0]
    if shard_id == "q":
        return layer.q_size * layer.tp.world_size
    if shard_id in ("k", "v"):
        return layer.kv_size * layer.tp.world_size // layer.kv_replicas
    return layer.sizes_per_rank[shard_id] * layer.tp.world_size


def _weight_loader(layer: nn.Module, original, scale_loader, scheme: Fp8Scheme, full_k: int):
    """fp8 tensors (a checkpoint's) load as they are; 16/32-bit ones are quantized with the scheme's recipe
    over the FULL tensor (so every tensor-parallel size gets the same bytes) and their scales loaded too."""
    def load(param: nn.Parameter, full: torch.Tensor, *shard) -> None:
        if full.dtype == FP8:
            original(param, full, *shard)
            return
        q, scale = fp8_quantize_weight_reference(full, scheme.block_n, scheme.block_k or full_k)
        original(param, q, *shard)
        scale_loader(layer.weight_scale_inv, scale, *shard)
    return load


def _fp8_matmul(self: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None,
                gated: bool = False) -> torch.Tensor:
    from spmd_engine.kernels.fp8_matmul import fp8_linear

    return fp8_linear(x, self.weight, self.weight_scale_inv, 1, self.fp8_block_k, self.fp8_group, bias,
                      out_dtype, gated)


def quantize_linear_layers(model: nn.Module, scheme: Fp8Scheme) -> int:
    """Turn every column- and row-parallel linear layer of `model` into an fp8 one (before loading weights);
    the number of layers converted. The LM head and embeddings are other classes and stay 16-bit."""
    layers = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    for layer in layers:
        Fp8Layer.convert(layer, scheme)
    return len(layers)


def scale_checkpoint_shapes(shapes: dict[str, tuple[int, ...]], scheme: Fp8Scheme) -> dict[str, tuple[int, ...]]:
    """The `weight_scale_inv` tensors an FP8 checkpoint holds next to its quantized projections' weights."""
    out = {}
    for name, shape in shapes.items():
        if ".layers." in name and name.endswith("_proj.weight") and len(shape) == 2:
            n, k = shape
            out[name.removesuffix("weight") + "weight_scale_inv"] = (_blocks(n, scheme.block_n),
                                                                     _blocks(k, scheme.block_k))
    return out
