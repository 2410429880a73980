"""Triton split-K GEMV for small batches: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for 1 <= M <= 16.

Why: at decode batch 1 cuBLAS reads the weights at ~1.5 TB/s of the H200's ~4.3 TB/s; the weight
read is the whole cost of a small-M matmul, so a kernel that streams W once at full width wins.

Design:
- One program owns a tile of BLOCK_N weight rows x one K slice and computes it for ALL M rows at
  once (`tl.dot` of the W tile [BLOCK_N, BLOCK_K] with x^T [BLOCK_K, BLOCK_M], "swap AB" so the
  weight rows are the MMA's long side): W is read exactly once whatever M is.
- Split-K without float atomics: with `split_k > 1` program (n, s) writes its float32 partial sum
  to a workspace [split_k, M, N]; the splits are then added in the fixed order 0, 1, ..., the bias
  added, and the sum rounded to the output dtype, by the last program of the N tile to finish (it
  counts arrivals on an int32 counter per N tile, and resets it): no second launch, which a decode
  step would pay ~110 times. With ONE_LAUNCH off the partials stay in the workspace for the tests'
  second-launch sum (tests/helpers/split_oracles.py), which must give the same bits. With
  `split_k == 1` (N tiles alone fill the GPU, e.g. the LM head) one program loops over the whole K and
  writes the output directly.
- Output: the activation dtype, or float32 (row-parallel partial sums before the TP all-reduce,
  float32 logits).
- `gated`: x holds a SwiGLU's packed gate | up and the input is silu(gate) * up, computed while
  loading x (`kernels/silu_and_mul.silu_mul`, so the same bits as the separate launch).

Determinism: BLOCK_M is always 16 (`GEMV_MAX_M`; padding rows load zeros) and M is a runtime
argument that Triton does not specialise on, so every M <= 16 runs the same compiled kernel; an
output element's value depends only on its own x row, W and the block choice, and the block choice
depends only on (N, K, dtype) (`gemv_config`). Row i of an M=3 batch therefore equals row i of the
same batch padded to M=4 bitwise (a decode batch eager vs its padded CUDA graph), and repeated
runs are bitwise identical. It is not bitwise cuBLAS: the K summation order differs.

Tuning lives in one place: `GEMV_TABLE` (explicit per-shape choices, e.g. from
`launch/bench/bench_gemv.py --sweep`) over the `_heuristic_config` fallback. Both are plain functions of
the shape, so the choice never happens inside CUDA-graph capture (the graphs' warm-up runs compile).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.pdl import pdl_launch, pdl_prologue
from spmd_engine.kernels.silu_and_mul import silu_mul

GEMV_MAX_M = 16  # the kernel's BLOCK_M: the largest M it takes (tl.dot needs a dim >= 16)
TARGET_PROGRAMS = 264  # programs wanted per launch (2 per SM of an H200's 132): more splits below it
MIN_K_PER_SPLIT = 256  # elements of K per split at the least (fewer: the partials cost more than they save)
# Split-K sums by the last program of each N tile. The arrival counters are one int32 per N tile per device,
# shared by every call: GEMVs must not run concurrently on two streams of one device (the engine runs its
# forward on one stream).


@dataclass(frozen=True)
class GemvConfig:
    """Block choice for one (N, K, dtype): it fixes the summation order, so it must not depend on M."""

    block_n: int  # weight rows per program (the MMA's long side; a power of two >= 16)
    block_k: int  # K elements per loop step (a power of two >= 16)
    split_k: int  # K slices (programs along K); 1 = one program runs the whole K, no second pass
    num_warps: int = 4
    num_stages: int = 4


# Explicit choices by (N, K, element size in bytes); shapes not listed use `_heuristic_config`.
# Chosen in situ (`python launch/bench/bench_gemv.py --in-situ`, H200): the whole
# batch-1 Qwen3-0.6B decode step of launch/bench/bench_pdl.py (PDL on, one CUDA graph, context 1024) timed while
# one shape's choice varies, over the shapes in turn: 1074 -> 980 us per step, and in the engine the
# batch-1 ITL p50 went 1.15 -> 1.05 ms (GPU busy 1.13 -> 1.04 ms). The isolated sweep (`--sweep`, no PDL,
# no neighbours) had picked differently: with PDL what counts is how a kernel overlaps its neighbours.
# A later pass's 2-4 us picks (qkv 64x128, down 64x64, 5 stages) cost 29 us per step in the engine: not
# taken. The LM head keeps the heuristic (64 x 128, no split).
GEMV_TABLE: dict[tuple[int, int, int], GemvConfig] = {
    (4096, 1024, 2): GemvConfig(block_n=64, block_k=256, split_k=1),  # Qwen3-0.6B qkv
    (1024, 2048, 2): GemvConfig(block_n=64, block_k=256, split_k=8, num_stages=3),  # o_proj
    (6144, 1024, 2): GemvConfig(block_n=64, block_k=128, split_k=1, num_stages=5),  # gate_up
    (1024, 3072, 2): GemvConfig(block_n=64, block_k=256, split_k=6, num_warps=8),  # down (gated)
}


def _heuristic_config(n: int, k: int, elem_bytes: int) -> GemvConfig:
    """64-row tiles (32 when that alone is too few programs), 256-byte K steps, enough K splits to
    give ~TARGET_PROGRAMS programs, each split at least MIN_K_PER_SPLIT long."""
    block_k = max(16, min(256 // elem_bytes, triton.next_power_of_2(k)))
    block_n = 64 if triton.cdiv(n, 64) * 4 >= TARGET_PROGRAMS else 32
    block_n = max(16, min(block_n, triton.next_power_of_2(n)))
    n_tiles, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    wanted = triton.cdiv(TARGET_PROGRAMS, n_tiles)
    most = max(1, k // MIN_K_PER_SPLIT)
    split = max(1, min(wanted, most, k_tiles))
    tiles_per_split = triton.cdiv(k_tiles, split)
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=triton.cdiv(k_tiles, tiles_per_split),
                      num_warps=4, num_stages=4 if elem_bytes <= 2 else 2)


@functools.cache
def gemv_config(n: int, k: int, elem_bytes: int) -> GemvConfig:
    """The block choice for y[M, n] = x[M, k] @ W[n, k]^T with `elem_bytes`-byte operands."""
    return GEMV_TABLE.get((n, k, elem_bytes)) or _heuristic_config(n, k, elem_bytes)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # kept alive: CUDA graphs captured earlier still point at them


def _split_counters(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 arrival counters (every kernel leaves them zero), allocated once per device,
    before any CUDA-graph capture: the first call of each shape is an eager warm-up."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gemv: split-K counters must be allocated before CUDA-graph capture "
                               "(run the model once eagerly first)")
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x, w, bias, out, partial, counters,
    M, N, K, stride_xm, stride_wn, stride_om, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, ONE_LAUNCH: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr, PRECISION: tl.constexpr, GATED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.arange(0, BLOCK_M)
    n_ok = rows_n < N
    m_ok = rows_m < M
    w_ids = rows_n
    if not EVEN_N:
        w_ids = tl.where(n_ok, rows_n, 0)  # the last tile re-reads row 0 instead of masking every load
    w_rows = w + w_ids.to(tl.int64)[:, None] * stride_wn
    x_rows = x + rows_m.to(tl.int64)[:, None] * stride_xm
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        cols = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)  # wide loads
        if EVEN_K:
            w_tile = tl.load(w_rows + cols[None, :])
            x_mask = m_ok[:, None]
        else:
            k_ok = cols < K
            w_tile = tl.load(w_rows + cols[None, :], mask=k_ok[None, :], other=0.0)
            x_mask = m_ok[:, None] & k_ok[None, :]
        x_tile = tl.load(x_rows + cols[None, :], mask=x_mask, other=0.0)
        if GATED:  # x rows are [gate | up] of width 2K: the input is silu(gate) * up, as silu_and_mul rounds it
            x_tile = silu_mul(x_tile, tl.load(x_rows + K + cols[None, :], mask=x_mask, other=0.0),
                              w_tile.dtype)
        acc = tl.dot(w_tile, tl.trans(x_tile), acc, input_precision=PRECISION)
    y = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            y += tl.load(bias + rows_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out + rows_m.to(tl.int64)[:, None] * stride_om + rows_n[None, :], y.to(out.dtype.element_ty),
                 mask=mask)
    else:
        offsets = rows_m.to(tl.int64)[:, None] * N + rows_n[None, :]
        slab = M.to(tl.int64) * N
        tl.store(partial + pid_k * slab + offsets, y, mask=mask)
        if ONE_LAUNCH:
            tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
            arrived = tl.atomic_add(counters + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:  # the N tile's last split: the others' partials are visible
                total = _sum_splits(partial, offsets, mask, slab, SPLIT)
                if HAS_BIAS:
                    total += tl.load(bias + rows_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                tl.store(out + rows_m.to(tl.int64)[:, None] * stride_om + rows_n[None, :],
                         total.to(out.dtype.element_ty), mask=mask)
                tl.store(counters + pid_n, 0)  # ready for the next call (the next launch sees it)


@triton.jit
def _sum_splits(partial, offsets, mask, slab, SPLIT: tl.constexpr):
    """partial[0] + partial[1] + ... in this order, read from L2 (`.cg`: never a stale L1 line)."""
    total = tl.load(partial + offsets, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT):
        total += tl.load(partial + s * slab + offsets, mask=mask, other=0.0, cache_modifier=".cg")
    return total


def _checked_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      out_dtype: torch.dtype | None, gated: bool) -> tuple[torch.Tensor, torch.dtype]:
    """`gemv`'s operands checked (a clear ValueError, not a kernel reading out of bounds): x as rows
    [M, K] (or [M, 2K] gated) with a contiguous last dim, and the output dtype."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dtype != x.dtype:
        raise ValueError(f"gemv: x and weight must share one of bf16/fp16/fp32, got {x.dtype}, {weight.dtype}")
    width = weight.shape[-1] * (2 if gated else 1)
    if weight.dim() != 2 or weight.stride(1) != 1 or x.shape[-1] != width:
        raise ValueError(f"gemv: weight must be [N, K] with contiguous rows and {'2K' if gated else 'K'} = x's "
                         f"last dim ({x.shape[-1]}), got {tuple(weight.shape)}")
    n = weight.shape[0]
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if not 1 <= x2.shape[0] <= GEMV_MAX_M:
        raise ValueError(f"gemv: rows must be in [1, {GEMV_MAX_M}], got {x2.shape[0]}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"gemv: bias must be a contiguous [{n}], got {tuple(bias.shape)}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"gemv: out_dtype must be x's dtype or float32, got {out_dtype}")
    return x2, out_dtype


def gemv(
    x: torch.Tensor,  # [..., K], 1 <= rows <= GEMV_MAX_M, last dim contiguous
    weight: torch.Tensor,  # [N, K], rows contiguous, same dtype as x
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,  # None: x.dtype; or torch.float32
    config: GemvConfig | None = None,  # None: gemv_config(N, K, element size); a bench passes others
    gated: bool = False,  # x is [..., 2K] = gate | up and the input is silu(gate) * up (a SwiGLU down_proj)
) -> torch.Tensor:
    """x @ weight^T (+ bias) accumulated in float32, rounded once to `out_dtype`; shape [..., N].

    `gated`: the same bits as `gemv(silu_and_mul(x), ...)`, without the activation's launch."""
    x2, out_dtype = _checked_operands(x, weight, bias, out_dtype, gated)
    (m, _), (n, k) = x2.shape, weight.shape
    cfg = config or gemv_config(n, k, x.element_size())
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # == cfg.split_k for table/heuristic configs
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    bias_arg = bias if bias is not None else weight
    n_tiles = triton.cdiv(n, cfg.block_n)
    counters = _split_counters(x.device, n_tiles) if split > 1 else partial  # unread with one split
    _gemv_kernel[(n_tiles, split)](
        x2, weight, bias_arg, out, partial, counters,
        m, n, k, x2.stride(0), weight.stride(0), out.stride(0), k_per_split,
        BLOCK_M=GEMV_MAX_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split, ONE_LAUNCH=split > 1,
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else None, GATED=gated,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x.device),
    )
    return out.view(*x.shape[:-1], n)
