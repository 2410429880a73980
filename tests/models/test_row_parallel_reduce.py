"""RowParallelLinear in bf16 over 2 ranks: a float32 all-reduce rounds once, as one rank does.

Inputs are small integers, so every float32 sum is exact whatever its order and each expected value
is one well-defined rounding; the partial sums need more than bf16's 8 significant bits, so rounding
each rank's partial before the sum (reduce_dtype=None) gives other values. tests/gpu runs the same
check over NCCL (torch.mm with out_dtype); here it runs on CPU over gloo.
"""
from pathlib import Path

import torch
import torch.nn.functional as F

from spmd_engine.models.layers.linear import RowParallelLinear
from spmd_engine.models.parallel import TensorParallel
from tests.helpers.spawned_ranks import run_on_ranks

IN, OUT = 64, 16


def integer_bf16(*shape: int, high: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-high, high + 1, shape, generator=gen).to(torch.bfloat16)


X = integer_bf16(2, 3, IN, high=64, seed=0)  # two leading dimensions
WEIGHT = integer_bf16(OUT, IN, high=64, seed=1)
BIAS = integer_bf16(OUT, high=100, seed=2)


def _layer(reduce_dtype: torch.dtype | None, device: str) -> RowParallelLinear:
    layer = RowParallelLinear(IN, OUT, TensorParallel.from_default_group(reduce_dtype), bias=True)
    layer = layer.to(device=device, dtype=torch.bfloat16)
    layer.weight.weight_loader(layer.weight, WEIGHT)
    layer.bias.weight_loader(layer.bias, BIAS)
    return layer


def row_parallel_worker(rank: int, out: Path, device: str) -> None:
    """Rank `rank` of 2: the layer's output with a float32 and with a model-dtype all-reduce, and the
    bf16 partial product this rank's device rounds before a model-dtype sum (where a device adds the
    bias, before or after rounding, is its own matter)."""
    x = X[..., rank * IN // 2:(rank + 1) * IN // 2].to(device)
    layer = _layer(None, device)
    partial = F.linear(x, layer.weight, layer.bias if rank == 0 else None)
    results = {"float32": _layer(torch.float32, device)(x), "model": layer(x), "partial": partial}
    torch.save({name: t.cpu() for name, t in results.items()}, out / f"rank{rank}.pt")


def check_row_parallel_outputs(out: Path) -> None:
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    once = (F.linear(X.float(), WEIGHT.float()) + BIAS.float()).to(torch.bfloat16)
    per_rank = ranks[0]["partial"] + ranks[1]["partial"]  # bf16 partials, summed and rounded again
    for result in ranks:  # every rank holds the same all-reduced output
        assert result["float32"].dtype == torch.bfloat16 and result["float32"].shape == (2, 3, OUT)
        assert torch.equal(result["float32"], once)
        assert torch.equal(result["model"], per_rank)
    assert not torch.equal(once, per_rank), "inputs must make the reduce dtype matter"


def test_float32_reduce_rounds_once_and_model_dtype_reduce_rounds_per_rank(tmp_path):
    run_on_ranks(row_parallel_worker, (tmp_path, "cpu"))
    check_row_parallel_outputs(tmp_path)
