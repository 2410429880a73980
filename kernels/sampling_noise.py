"""Triton counter-based sampling noise: one launch for every row of a batch, no generator state.

A row's noise over the vocabulary is a pure 32-bit hash of (seed, counter, round, column), so a
request's draws depend on nothing but its own seed and token index, whatever else is batched with
it. Bit-identical to `reference.sampling_hash_reference` (uint32 arithmetic in both, numpy's
there); the float conversion is the same formula (`reference.gumbel_from_hash_reference`), equal
up to the device's log rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd_engine.kernels.reference import COLUMN_MUL, HASH_MUL1, HASH_MUL2, LANE_A, LANE_B

BLOCK = 1024
MODE_BITS, MODE_GUMBEL = 0, 1  # raw hash (int64 out, for tests) or Gumbel noise (float32 out)


@triton.jit
def _fmix32(h, MUL1: tl.constexpr, MUL2: tl.constexpr):
    h = h ^ (h >> 16)
    h = h * tl.full((), MUL1, tl.uint32)
    h = h ^ (h >> 13)
    h = h * tl.full((), MUL2, tl.uint32)
    return h ^ (h >> 16)


@triton.jit
def _row_keys(seed, counter, rnd, MUL1: tl.constexpr, MUL2: tl.constexpr, A0: tl.constexpr, B0: tl.constexpr):
    """The two 32-bit lanes of one row (see `reference.sampling_row_keys_reference`)."""
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    ctr_lo = (counter & 0xFFFFFFFF).to(tl.uint32)
    ctr_hi = ((counter >> 32) & 0xFFFFFFFF).to(tl.uint32)
    a = _fmix32(seed_lo ^ tl.full((), A0, tl.uint32), MUL1, MUL2)
    a = _fmix32(a ^ seed_hi, MUL1, MUL2)
    a = _fmix32(a ^ ctr_lo, MUL1, MUL2)
    a = _fmix32(a ^ ctr_hi, MUL1, MUL2)
    a = _fmix32(a ^ rnd, MUL1, MUL2)
    b = _fmix32(rnd + tl.full((), B0, tl.uint32), MUL1, MUL2)
    b = _fmix32(b + ctr_hi, MUL1, MUL2)
    b = _fmix32(b + ctr_lo, MUL1, MUL2)
    b = _fmix32(b + seed_hi, MUL1, MUL2)
    b = _fmix32(b + seed_lo, MUL1, MUL2)
    return a, b


@triton.jit
def _column_hash(a, b, cols, MUL1: tl.constexpr, MUL2: tl.constexpr, CMUL: tl.constexpr):
    inner = _fmix32(cols.to(tl.uint32) * tl.full((), CMUL, tl.uint32) + b, MUL1, MUL2)
    return _fmix32(inner ^ a, MUL1, MUL2)


@triton.jit
def _gumbel_from_hash(h):
    """Same formula as `reference.gumbel_from_hash_reference`."""
    v = h.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10  # 2**-32, 2**-33
    v = tl.minimum(v, 0.9999999403953552)  # 1 - 2**-24
    series = v * (1.0 + v * (0.5 + v * (0.3333333432674408 + v * 0.25)))
    e = tl.where(v < 0.015625, series, -tl.log(1.0 - v))
    return -tl.log(e)


@triton.jit
def _sampling_noise_kernel(seeds, counters, out, rnd, vocab,
                           MODE: tl.constexpr, BLOCK: tl.constexpr, MUL1: tl.constexpr, MUL2: tl.constexpr,
                           A0: tl.constexpr, B0: tl.constexpr, CMUL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    seed = tl.load(seeds + row).to(tl.int64)
    counter = tl.load(counters + row).to(tl.int64)
    rnd = (tl.zeros((), tl.int32) + rnd).to(tl.uint32)  # a tensor even where Triton made round 1 a constant
    a, b = _row_keys(seed, counter, rnd, MUL1, MUL2, A0, B0)
    h = _column_hash(a, b, cols, MUL1, MUL2, CMUL)
    if MODE == 0:
        tl.store(out + row * vocab + cols, h.to(tl.int64), mask=mask)
    else:
        tl.store(out + row * vocab + cols, _gumbel_from_hash(h), mask=mask)


def _launch(seeds: torch.Tensor, counters: torch.Tensor, round_: int, vocab: int, mode: int) -> torch.Tensor:
    if seeds.dim() != 1 or counters.shape != seeds.shape:
        raise ValueError(f"sampling noise: seeds and counters must be [N], got {tuple(seeds.shape)} and "
                         f"{tuple(counters.shape)}")
    if not 0 <= round_ < 2**31:
        raise ValueError(f"sampling noise: round must be in [0, 2**31), got {round_}")
    rows = seeds.shape[0]
    out = torch.empty(rows, vocab, device=seeds.device, dtype=torch.int64 if mode == MODE_BITS else torch.float32)
    if rows and vocab:
        _sampling_noise_kernel[(rows, triton.cdiv(vocab, BLOCK))](
            seeds.long().contiguous(), counters.long().contiguous(), out, round_, vocab,
            MODE=mode, BLOCK=BLOCK, MUL1=HASH_MUL1, MUL2=HASH_MUL2, A0=LANE_A, B0=LANE_B, CMUL=COLUMN_MUL,
            num_warps=4)
    return out


def sampling_hash(seeds: torch.Tensor, counters: torch.Tensor, round_: int, vocab: int) -> torch.Tensor:
    """The raw 32-bit hashes, [N, vocab] int64 in [0, 2**32) (what the tests compare bit for bit)."""
    return _launch(seeds, counters, round_, vocab, MODE_BITS)


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, round_: int, vocab: int) -> torch.Tensor:
    """seeds [N] int64 (a uint64 seed's bits), counters [N] int64 -> [N, vocab] float32 Gumbel noise."""
    return _launch(seeds, counters, round_, vocab, MODE_GUMBEL)


@triton.jit
def _gumbel_race_kernel(logits, temps, seeds, counters, best_scores, best_cols, vocab, stride_row, num_chunks,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, MUL1: tl.constexpr, MUL2: tl.constexpr,
                        A0: tl.constexpr, B0: tl.constexpr, CMUL: tl.constexpr):
    """One program per (row, vocabulary chunk): the chunk's best logits / T + round-0 Gumbel noise and
    its column, the noise made in registers (no [N, V] tensor); ties go to the lowest column, as
    torch.argmax. Chunks rather than whole rows: a row per program leaves most of the GPU idle."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    seed = tl.load(seeds + row).to(tl.int64)
    counter = tl.load(counters + row).to(tl.int64)
    temp = tl.load(temps + row)
    a, b = _row_keys(seed, counter, tl.full((), 0, tl.uint32), MUL1, MUL2, A0, B0)
    best = tl.full((), float("-inf"), tl.float32)
    best_col = tl.full((), 0, tl.int64) + chunk * CHUNK
    for offset in range(0, CHUNK, BLOCK):
        cols = chunk * CHUNK + offset + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(logits + row * stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        score = tl.div_rn(x, temp) + _gumbel_from_hash(_column_hash(a, b, cols, MUL1, MUL2, CMUL))
        score = tl.where(mask, score, float("-inf"))
        block_best = tl.max(score, axis=0)
        block_col = tl.min(tl.where(score == block_best, cols, vocab), axis=0).to(tl.int64)
        better = block_best > best  # strictly: an earlier block keeps a tie
        best_col = tl.where(better, block_col, best_col)
        best = tl.where(better, block_best, best)
    tl.store(best_scores + row * num_chunks + chunk, best)
    tl.store(best_cols + row * num_chunks + chunk, best_col)


RACE_CHUNK = 4 * BLOCK  # columns per program of the fused race


def gumbel_race(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                counters: torch.Tensor) -> torch.Tensor:
    """argmax(logits / T + gumbel_noise(seeds, counters, 0)) per row, fused: the plain temperature
    draw of the sampler without materialising the noise. logits [N, V] (last dim contiguous),
    temperatures [N] float32, seeds / counters [N] int64 -> [N] int64."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"gumbel_race: logits must be [N, V] with a contiguous last dim, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if temperatures.shape != (rows,) or seeds.shape != (rows,) or counters.shape != (rows,):
        raise ValueError(f"gumbel_race: temperatures, seeds and counters must be [{rows}]")
    if not rows or not vocab:
        return torch.zeros(rows, device=logits.device, dtype=torch.int64)
    num_chunks = triton.cdiv(vocab, RACE_CHUNK)
    scores = torch.empty(rows, num_chunks, device=logits.device, dtype=torch.float32)
    cols = torch.empty(rows, num_chunks, device=logits.device, dtype=torch.int64)
    _gumbel_race_kernel[(rows, num_chunks)](
        logits, temperatures.float().contiguous(), seeds.long().contiguous(), counters.long().contiguous(),
        scores, cols, vocab, logits.stride(0), num_chunks,
        CHUNK=RACE_CHUNK, BLOCK=BLOCK, MUL1=HASH_MUL1, MUL2=HASH_MUL2, A0=LANE_A, B0=LANE_B, CMUL=COLUMN_MUL,
        num_warps=4)
    # the first chunk holding the row's maximum (torch.argmax takes the first): the lowest column
    return cols.gather(1, scores.argmax(dim=1, keepdim=True)).squeeze(1)
