"""Second-launch oracles for the product's one-launch split reductions: the decode attention's split merge
(kernels/decode_attention.py) and the GEMV's split-K sum (kernels/gemv.py).

Why: in the product the last split program to arrive reduces the splits inside the split kernel (an arrival
counter, an acq_rel atomic). A test checks that against a second computation: the very same split kernel
launched with its in-kernel reduction off (its FUSED_MERGE / ONE_LAUNCH constexpr), which leaves the float32
partials in the workspace, then reduced here by a kernel written apart in the product's order of operations
(sequential over splits). The two must agree bit for bit; a race in the arrival protocol, a stale partial or
a change of the product's float order shows up as different bits.

`second_launch_reductions()` stands in for the two split kernels' `kernel[grid]` in their modules for the
duration of a `with` block, so `paged_decode_attention` and `gemv` called inside it (directly or from a whole
decode step, tests/helpers/decode_step.py) run the product's own launch code and shapes with the oracle's
second launch. The oracle kernels keep the product's launch rules (kernels/pdl.py: PDL where asked for),
so a step run this way is also a PDL chain of split kernel and second launch.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl

from spmd_engine.kernels import decode_attention, gemv
from spmd_engine.kernels.pdl import pdl_launch, pdl_prologue

SUM_BLOCK = 256  # output columns per program of the split-K sum


@triton.jit
def _merge_splits_kernel(
    partial_out, partial_lse, out, stride_o_seq, stride_o_head, num_q_heads,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One (sequence, query head): its splits' outputs weighted by exp2(lse - max lse), in split order."""
    pdl_prologue(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    first = (seq * num_q_heads + head) * NUM_SPLITS + tl.zeros([1, 1], dtype=tl.int64)  # split 0's slot
    top = tl.load(partial_lse + first)
    for s in tl.static_range(1, NUM_SPLITS):
        top = tl.maximum(top, tl.load(partial_lse + first + s))
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: all weights 0
    weights = tl.zeros([1, 1], dtype=tl.float32)
    merged = tl.zeros([1, HEAD_DIM], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        weight = tl.exp2(tl.load(partial_lse + first + s) - top)
        weights += weight
        merged += tl.load(partial_out + (first + s) * HEAD_DIM + dims[None, :]) * weight
    merged = merged / tl.where(weights == 0.0, 1.0, weights)
    tl.store(out + seq * stride_o_seq + head * stride_o_head + dims[None, :], merged.to(out.dtype.element_ty))


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(
    partial, bias, out, M, N, stride_om,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One row's BLOCK columns: partial[0] + partial[1] + ... in split order, then the bias, rounded once."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < N
    slab = M.to(tl.int64) * N
    total = tl.load(partial + row * N + cols, mask=live, other=0.0)
    for s in tl.static_range(1, SPLIT):
        total += tl.load(partial + s * slab + row * N + cols, mask=live, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(out + row * stride_om + cols, total.to(out.dtype.element_ty), mask=live)


def merge_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor) -> None:
    """The split partials [B, Hq, S, D] / [B, Hq, S] (float32) merged into `out` [B, Hq, D]."""
    num_seqs, num_q_heads, num_splits, head_dim = partial_out.shape
    _merge_splits_kernel[(num_seqs, num_q_heads)](
        partial_out, partial_lse, out, out.stride(0), out.stride(1), num_q_heads,
        NUM_SPLITS=num_splits, HEAD_DIM=head_dim, num_warps=1 if head_dim <= 64 else 2, **pdl_launch(out.device),
    )


def sum_splits(partial: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """The split-K partial sums [S, M, N] (float32) added in split order, plus `bias` [N], into `out` [M, N]."""
    split, m, n = partial.shape
    _sum_splits_kernel[(m, triton.cdiv(n, SUM_BLOCK))](
        partial, bias if bias is not None else partial, out, m, n, out.stride(0),
        SPLIT=split, HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK, num_warps=4, **pdl_launch(out.device),
    )


def _merge_decode(args: dict[str, Any], meta: dict[str, Any]) -> bool:
    if meta["NUM_SPLITS"] == 1:  # the split kernel wrote `out` itself
        return False
    merge_splits(args["partial_out"], args["partial_lse"], args["out"])
    return True


def _sum_gemv(args: dict[str, Any], meta: dict[str, Any]) -> bool:
    if meta["SPLIT"] == 1:
        return False
    sum_splits(args["partial"], args["bias"] if meta["HAS_BIAS"] else None, args["out"])
    return True


@dataclass
class SecondLaunches:
    """The oracle launches made inside `second_launch_reductions` (by kernel name): a test asserts it ran."""

    names: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _ReducedApart:
    """Stands in for a split kernel's `kernel[grid]`: launches it with `flag` (its in-kernel reduction) off,
    then `reduce(args by name, constexprs)` reduces the partials it left, in a second launch."""

    kernel: Any
    flag: str
    reduce: Callable[[dict[str, Any], dict[str, Any]], bool]
    launches: SecondLaunches

    def __getitem__(self, grid):
        def launch(*args, **meta):
            if self.flag not in meta:
                raise AssertionError(f"{self.kernel.fn.__name__} launched without its {self.flag} constexpr")
            self.kernel[grid](*args, **{**meta, self.flag: False})
            if self.reduce(dict(zip(self.kernel.arg_names, args)), meta):
                self.launches.names.append(self.kernel.fn.__name__)
        return launch


@contextlib.contextmanager
def second_launch_reductions() -> Iterator[SecondLaunches]:
    """Within: `paged_decode_attention` merges its splits, and `gemv` sums its split-K partials, by the
    oracle kernels above in a second launch (module doc)."""
    launches = SecondLaunches()
    stand_ins = [(decode_attention, "_decode_split_kernel", "FUSED_MERGE", _merge_decode),
                 (gemv, "_gemv_kernel", "ONE_LAUNCH", _sum_gemv)]
    originals = [(module, name, getattr(module, name)) for module, name, _, _ in stand_ins]
    try:
        for module, name, flag, reduce in stand_ins:
            setattr(module, name, _ReducedApart(getattr(module, name), flag, reduce, launches))
        yield launches
    finally:
        for module, name, kernel in originals:
            setattr(module, name, kernel)
