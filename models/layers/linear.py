"""Tensor-parallel linear layers (Megatron style): column-parallel splits output features, so its
output stays sharded for the next layer; row-parallel splits input features and all-reduces.

Each parameter's `weight_loader` takes the FULL checkpoint tensor and keeps this rank's rows or
columns, so checkpoints never need resharding. Packed layers (qkv, gate|up) take one checkpoint
tensor per `shard_id`.

Every matmul here and in the LM head goes through `linear`: on CUDA, bf16/fp16 inputs of at most
SMALL_BATCH_MAX_M rows (decode at small batch) take the Triton split-K GEMV (`kernels/gemv.py`),
which reads the weights near bandwidth where cuBLAS does not; everything else takes cuBLAS / torch.
The engine turns it off everywhere only on the developer override `debug.small_batch_gemv=false`
(`set_small_batch_gemv`, for A/B benches).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from spmd_engine.models.layers.activation import silu_and_mul
from spmd_engine.models.layers.weight_loading import copy_checked, new_parameter, replicated_loader
from spmd_engine.models.parallel import TensorParallel


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by the tensor-parallel size {parts}")
    return total // parts


# Rows up to which CUDA matmuls take the GEMV. Keep it a CUDA-graph batch size (1, 2, 4, 8 or 16:
# executor/cuda_graphs.py) so that a decode batch and the graph it is padded to take the same kernel
# and give the same bits; at most kernels.gemv.GEMV_MAX_M (16). Pick it with launch/bench/bench_gemv.py.
SMALL_BATCH_MAX_M = 16


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _gemv_device(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()


def use_small_batch_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` sends x @ weight^T to the Triton GEMV (the layers' switch aside): CUDA,
    bf16/fp16 (float32 stays on cuBLAS, which reads it fine), 1..SMALL_BATCH_MAX_M rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (1 <= rows <= SMALL_BATCH_MAX_M and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.dim() == 2 and weight.stride(1) == 1 and _gemv_device(x))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, small_batch_gemv: bool = True, gated: bool = False) -> torch.Tensor:
    """x @ weight^T (+ bias), summed in float32 on CUDA and rounded once to `out_dtype` (None: x's
    dtype; torch.float32 keeps bf16/fp16 results unrounded). Small batches on CUDA: the GEMV.

    `gated`: x is [..., 2K] = gate | up of a SwiGLU and the input is silu(gate) * up; the GEMV computes
    it while loading x (the same bits as silu_and_mul first, one launch fewer)."""
    if small_batch_gemv and use_small_batch_gemv(x, weight):
        from spmd_engine.kernels.gemv import gemv

        return gemv(x, weight, bias, out_dtype, gated=gated)
    if gated:
        x = silu_and_mul(x)
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, weight, bias)
    y = matmul_fp32_out(x, weight)
    if bias is not None:
        y += bias
    return y


class SmallBatchSwitch:
    """Mixin of the layers whose matmul `linear` may send to the GEMV; on unless switched off."""

    small_batch_gemv: bool = True


def set_small_batch_gemv(model: nn.Module, enabled: bool) -> None:
    """Turn the small-batch GEMV on or off in every layer of `model` (the engine passes `debug.small_batch_gemv`)."""
    for module in model.modules():
        if isinstance(module, SmallBatchSwitch):
            module.small_batch_gemv = enabled


def matmul_fp32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T as float32 from bf16/fp16 `x` and `weight` of the same dtype, never rounded to it.

    CUDA: cuBLAS accumulates in float32 anyway; out_dtype only drops its final rounding. CPU has no
    out_dtype matmul; upcasting the operands first is equivalent (no rounding to the operands' dtype
    anywhere), since a product of two bf16 (or fp16) values is exact in float32.
    """
    if not x.is_cuda:
        return F.linear(x.float(), weight.float())
    y = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
    return y.view(*x.shape[:-1], weight.shape[0])


class ColumnParallelLinear(SmallBatchSwitch, nn.Module):
    """y = x W^T + b with W's rows (output features) split evenly across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, tp: TensorParallel, bias: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.output_size_per_rank = divide(output_size, tp.world_size, "output features")
        self.weight = new_parameter(self.output_size_per_rank, input_size, loader=self.load_rows)
        self.bias = new_parameter(self.output_size_per_rank, loader=self.load_rows) if bias else None

    def load_rows(self, param: nn.Parameter, full: torch.Tensor) -> None:
        rows = param.shape[0]
        copy_checked(param.data, full.narrow(0, self.tp.rank * rows, rows), "column-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None,
               gated: bool = False) -> torch.Tensor:
        """x @ weight^T (+ bias): `linear`; a quantized layer replaces it (models/layers/fp8_linear.py)."""
        return linear(x, self.weight, bias, out_dtype, small_batch_gemv=self.small_batch_gemv, gated=gated)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input packed into one matmul (gate | up).

    Each rank holds [its rows of projection 0 | its rows of projection 1 | ...]; checkpoint
    tensor i is loaded with shard_id=i.
    """

    def __init__(self, input_size: int, output_sizes: list[int], tp: TensorParallel, bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), tp, bias)
        self.sizes_per_rank = [divide(size, tp.world_size, "output features") for size in output_sizes]
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.load_packed

    def load_packed(self, param: nn.Parameter, full: torch.Tensor, shard_id: int) -> None:
        rows = self.sizes_per_rank[shard_id]
        offset = sum(self.sizes_per_rank[:shard_id])
        copy_checked(param.data.narrow(0, offset, rows), full.narrow(0, self.tp.rank * rows, rows),
                     f"packed projection {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections packed per rank as [q heads | k heads | v heads].

    Query heads are split across ranks. KV heads are split too when there are at least as many as
    ranks; otherwise (tp % num_kv_heads == 0) each KV head is replicated on tp / num_kv_heads
    consecutive ranks, which then hold one KV head each.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 tp: TensorParallel, bias: bool = False) -> None:
        num_heads = divide(total_num_heads, tp.world_size, "num_attention_heads")
        if tp.world_size >= total_num_kv_heads:
            num_kv_heads = 1
            kv_replicas = divide(tp.world_size, total_num_kv_heads, "tensor-parallel size vs num_key_value_heads")
        else:
            num_kv_heads, kv_replicas = divide(total_num_kv_heads, tp.world_size, "num_key_value_heads"), 1
        per_rank = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, per_rank * tp.world_size, tp, bias)
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads, self.kv_replicas = num_heads, num_kv_heads, kv_replicas
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.load_qkv

    def load_qkv(self, param: nn.Parameter, full: torch.Tensor, shard_id: str) -> None:
        if shard_id == "q":
            offset, rows, start = 0, self.q_size, self.tp.rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            rows = self.kv_size
            start = (self.tp.rank // self.kv_replicas) * self.kv_size
        else:
            raise ValueError(f"qkv shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        copy_checked(param.data.narrow(0, offset, rows), full.narrow(0, start, rows), f"{shard_id}_proj")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(SmallBatchSwitch, nn.Module):
    """y = all_reduce(x_shard W_shard^T) + b with W's columns (input features) split across ranks.

    The input is the rank's shard of the features (the output of a column-parallel layer). The
    bias is replicated and added once, by rank 0, before the sum.

    With tp.reduce_dtype=float32 and bf16/fp16 activations on several ranks, the partial products
    stay float32 through the all-reduce and are rounded once, after it, as a single rank's matmul
    rounds once: summing rounded partials would round twice and flip near-tie greedy tokens.
    """

    def __init__(self, input_size: int, output_size: int, tp: TensorParallel, bias: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.input_size_per_rank = divide(input_size, tp.world_size, "input features")
        self.weight = new_parameter(output_size, self.input_size_per_rank, loader=self.load_columns)
        self.bias = new_parameter(output_size, loader=replicated_loader) if bias else None

    def load_columns(self, param: nn.Parameter, full: torch.Tensor) -> None:
        cols = param.shape[1]
        copy_checked(param.data, full.narrow(1, self.tp.rank * cols, cols), "row-parallel weight")

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """`gated`: x is [T, 2 x input features] = gate | up and the input is silu(gate) * up (`linear`)."""
        bias = self.bias if self.tp.is_first else None
        if self.tp.world_size == 1 or self.tp.reduce_dtype is None or x.dtype not in (torch.bfloat16, torch.float16):
            return self.tp.all_reduce(self.matmul(x, bias, gated=gated))
        y = self.matmul(x, bias, out_dtype=torch.float32, gated=gated)
        return self.tp.all_reduce(y).to(x.dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None,
               gated: bool = False) -> torch.Tensor:
        """This rank's x @ weight^T (+ bias), before the all-reduce: `linear`; a quantized layer replaces it."""
        return linear(x, self.weight, bias, out_dtype, small_batch_gemv=self.small_batch_gemv, gated=gated)
