"""Triton counter-based sampling noise: one launch for every row of a batch, no generator state.

A row's noise over the vocabulary is a pure 32-bit hash of (seed, counter, round, column), so a
request's draws depend on nothing but its own seed and token index, whatever else is batched with
it. Bit-identical to `reference.sampling_hash_reference` (uint32 arithmetic in both, numpy's
there); the float conversion is the same formula (`reference._gumbel_from_hash_np`), equal
up to the log's rounding: on the GPU the hardware's approximate log2 (MUFU, ~2**-22 relative; see
`FAST_LOG`).

Kernels: the noise of whole rows (`gumbel_noise`) or of given columns (`gumbel_noise_at`, the top-k
candidates), the fused plain draw (`gumbel_race`), and the whole top-p draw of a row with its
rejection rounds and exact fallback spread over (row, chunk) programs (`nucleus_sample`), so the
sampler never waits for the GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import libdevice

from spmd_engine.kernels.pdl import pdl_launch, pdl_prologue, triton_interpreting
from spmd_engine.kernels.reference import COLUMN_MUL, HASH_MUL1, HASH_MUL2, LANE_A, LANE_B

BLOCK = 1024
# Gumbel noise takes two logs per column. libdevice's accurate logf is ~24 instructions, and the race
# (one program per 4k columns of a row) was issue-bound at 137 instructions per column: 73 us for
# 128 rows x 152k columns on an H200, where its fp32 logits need ~20 us of bandwidth. MUFU lg2 is one
# (sm_90 SASS, Triton 3.6: the race's static count 1,208 -> 824). The interpreter has no libdevice.
FAST_LOG = tl.constexpr(not triton_interpreting())
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
def _log(x):
    """Natural log: the hardware's approximate one on the GPU (`FAST_LOG`), tl.log in the interpreter."""
    if FAST_LOG:
        return libdevice.fast_logf(x)
    else:
        return tl.log(x)


@triton.jit
def _gumbel_from_hash(h):
    """Same formula as `reference._gumbel_from_hash_np` (inputs of both logs are normal floats: >= 2**-24)."""
    v = h.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10  # 2**-32, 2**-33
    v = tl.minimum(v, 0.9999999403953552)  # 1 - 2**-24
    series = v * (1.0 + v * (0.5 + v * (0.3333333432674408 + v * 0.25)))
    e = tl.where(v < 0.015625, series, -_log(1.0 - v))
    return -_log(e)


@triton.jit
def _sampling_noise_kernel(seeds, counters, out, rnd, vocab,
                           MODE: tl.constexpr, BLOCK: tl.constexpr, MUL1: tl.constexpr, MUL2: tl.constexpr,
                           A0: tl.constexpr, B0: tl.constexpr, CMUL: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
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
            num_warps=4, **pdl_launch(seeds.device))
    return out


@triton.jit
def _noise_at_kernel(seeds, counters, cols, out, rnd, width,
                     BLOCK: tl.constexpr, MUL1: tl.constexpr, MUL2: tl.constexpr, A0: tl.constexpr,
                     B0: tl.constexpr, CMUL: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    seed = tl.load(seeds + row).to(tl.int64)
    counter = tl.load(counters + row).to(tl.int64)
    rnd = (tl.zeros((), tl.int32) + rnd).to(tl.uint32)
    a, b = _row_keys(seed, counter, rnd, MUL1, MUL2, A0, B0)
    c = tl.load(cols + row * width + offs, mask=mask, other=0)
    tl.store(out + row * width + offs, _gumbel_from_hash(_column_hash(a, b, c, MUL1, MUL2, CMUL)), mask=mask)


NOISE_AT_BLOCK = 256


def gumbel_noise_at(seeds: torch.Tensor, counters: torch.Tensor, round_: int, cols: torch.Tensor) -> torch.Tensor:
    """The Gumbel noise of row i at its columns cols[i] only: cols [N, C] int64 -> [N, C] float32, equal
    to `gumbel_noise(seeds, counters, round_, vocab).gather(1, cols)` (the same code per element)
    without making the [N, vocab] noise (the top-k path needs a few columns per row)."""
    if cols.dim() != 2 or seeds.shape != (cols.shape[0],) or counters.shape != seeds.shape:
        raise ValueError(f"gumbel_noise_at: cols must be [N, C] with seeds and counters [N], got "
                         f"{tuple(cols.shape)}, {tuple(seeds.shape)} and {tuple(counters.shape)}")
    if not 0 <= round_ < 2**31:
        raise ValueError(f"gumbel_noise_at: round must be in [0, 2**31), got {round_}")
    rows, width = cols.shape
    out = torch.empty(rows, width, device=cols.device, dtype=torch.float32)
    if rows and width:
        _noise_at_kernel[(rows, triton.cdiv(width, NOISE_AT_BLOCK))](
            seeds.long().contiguous(), counters.long().contiguous(), cols.long().contiguous(), out, round_, width,
            BLOCK=NOISE_AT_BLOCK, MUL1=HASH_MUL1, MUL2=HASH_MUL2, A0=LANE_A, B0=LANE_B, CMUL=COLUMN_MUL,
            num_warps=4, **pdl_launch(cols.device))
    return out


def sampling_hash(seeds: torch.Tensor, counters: torch.Tensor, round_: int, vocab: int) -> torch.Tensor:
    """The raw 32-bit hashes, [N, vocab] int64 in [0, 2**32) (what the tests compare bit for bit)."""
    return _launch(seeds, counters, round_, vocab, MODE_BITS)


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, round_: int, vocab: int) -> torch.Tensor:
    """seeds [N] int64 (a uint64 seed's bits), counters [N] int64 -> [N, vocab] float32 Gumbel noise."""
    return _launch(seeds, counters, round_, vocab, MODE_GUMBEL)


@triton.jit
def _keep_best(score, cols, vocab, best, best_col):
    """One block of a race: its best score and lowest column on ties, kept if strictly better than
    the best so far (an earlier block keeps a tie, as torch.argmax)."""
    block_best = tl.max(score, axis=0)
    block_col = tl.min(tl.where(score == block_best, cols, vocab), axis=0).to(tl.int64)
    better = block_best > best
    return tl.where(better, block_best, best), tl.where(better, block_col, best_col)


@triton.jit
def _gumbel_race_kernel(logits, temps, seeds, counters, best_scores, best_cols, vocab, stride_row, num_chunks,
                        chunk_max, done_round, picks, arrivals, tokens, empty,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                        MUL1: tl.constexpr, MUL2: tl.constexpr, A0: tl.constexpr, B0: tl.constexpr,
                        CMUL: tl.constexpr, USE_PDL: tl.constexpr, WITH_STATS: tl.constexpr = False,
                        PICK: tl.constexpr = False):
    """One program per (row, vocabulary chunk): the chunk's best logits / T + round-0 Gumbel noise and
    its column, the noise made in registers (no [N, V] tensor); ties go to the lowest column, as
    torch.argmax. Chunks rather than whole rows: a row per program leaves most of the GPU idle.
    WITH_STATS (the nucleus draw's round 0): also the chunk's largest logits / T (the softmax sums wait for
    the row's maximum: round 0's mass pass), and every row marked undecided (done_round -1).
    PICK (the plain draw): instead of storing its best, each program folds (score, lowest column) into the
    row's int64 in `picks` with an atomic max (the score's order-preserving bits above the column's
    complement: the highest score, then the lowest column, as argmax over the chunks then the columns), and
    the row's last program to arrive writes the token and puts `picks` (to `empty`) and `arrivals` (to 0)
    back, so the next launch finds them ready: one launch instead of the race, an argmax and a gather.
    A PICK row of temperature 0 is skipped whole (its token left as it was): the sampler graphs' padding."""
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    seed = tl.load(seeds + row).to(tl.int64)
    counter = tl.load(counters + row).to(tl.int64)
    temp = tl.load(temps + row)
    if PICK:
        if temp == 0.0:  # a sampler graph's padding row (no real row races at T = 0): nothing to draw
            return
    a, b = _row_keys(seed, counter, tl.full((), 0, tl.uint32), MUL1, MUL2, A0, B0)
    # each lane keeps its own best over the blocks (strictly better only: its lowest column on ties), and
    # the lanes are reduced once at the end: one cross-warp reduction per chunk instead of two per block
    lane_best = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_col = tl.zeros((BLOCK,), tl.int32) + chunk * CHUNK
    lane_top = tl.full((BLOCK,), float("-inf"), tl.float32)  # WITH_STATS: each lane's largest logits / T
    for offset in range(0, CHUNK, BLOCK):
        cols = chunk * CHUNK + offset + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(logits + row * stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        z = tl.div_rn(x, temp)
        if WITH_STATS:
            lane_top = tl.maximum(lane_top, tl.where(mask, z, float("-inf")))
        score = z + _gumbel_from_hash(_column_hash(a, b, cols, MUL1, MUL2, CMUL))
        score = tl.where(mask, score, float("-inf"))
        better = score > lane_best
        lane_best = tl.where(better, score, lane_best)
        lane_col = tl.where(better, cols, lane_col)
    best = tl.max(lane_best, axis=0)
    best_col = tl.min(tl.where(lane_best == best, lane_col, vocab), axis=0).to(tl.int64)
    if PICK:
        complement = 4294967295 - best_col  # in [0, 2**32): a lower column packs higher
        tl.atomic_max(picks + row, (_float_key(best).to(tl.int64) << 32) | complement)
        if tl.atomic_add(arrivals + row, 1) == num_chunks - 1:  # acq_rel: every other chunk's max is in
            packed = tl.atomic_xchg(picks + row, empty)
            tl.store(tokens + row, 4294967295 - (packed & 4294967295))
            tl.atomic_xchg(arrivals + row, 0)
    else:
        tl.store(best_scores + row * num_chunks + chunk, best)
        tl.store(best_cols + row * num_chunks + chunk, best_col)
    if WITH_STATS:
        tl.store(chunk_max + row * num_chunks + chunk, tl.max(lane_top, axis=0))
        if chunk == 0:
            tl.store(done_round + row, -1)


RACE_CHUNK = 4 * BLOCK  # columns per program of the fused race


def gumbel_race(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                counters: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """argmax(logits / T + gumbel_noise(seeds, counters, 0)) per row, fused: the plain temperature
    draw of the sampler without materialising the noise. logits [N, V] (last dim contiguous; float32,
    or bf16 / fp16 raced as their float32 values), temperatures [N] float32, seeds / counters [N] int64
    -> [N] int64 (`out` if given). A row of temperature 0 is skipped: its token is left as it was."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"gumbel_race: logits must be [N, V] with a contiguous last dim, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if temperatures.shape != (rows,) or seeds.shape != (rows,) or counters.shape != (rows,):
        raise ValueError(f"gumbel_race: temperatures, seeds and counters must be [{rows}]")
    if out is not None and (out.shape != (rows,) or out.dtype != torch.int64 or not out.is_contiguous()):
        raise ValueError(f"gumbel_race: out must be a contiguous int64 [{rows}], got {tuple(out.shape)} {out.dtype}")
    if not rows or not vocab:
        return torch.zeros(rows, device=logits.device, dtype=torch.int64) if out is None else out.zero_()
    num_chunks = triton.cdiv(vocab, RACE_CHUNK)
    picks, arrivals = _race_state(logits.device, rows)
    tokens = torch.empty(rows, device=logits.device, dtype=torch.int64) if out is None else out
    _gumbel_race_kernel[(rows, num_chunks)](
        logits, temperatures.float().contiguous(), seeds.long().contiguous(), counters.long().contiguous(),
        tokens, tokens, vocab, logits.stride(0), num_chunks, tokens, tokens,  # unread with PICK
        picks, arrivals, tokens, _PICK_EMPTY,
        CHUNK=RACE_CHUNK, BLOCK=BLOCK, MUL1=HASH_MUL1, MUL2=HASH_MUL2, A0=LANE_A, B0=LANE_B, CMUL=COLUMN_MUL,
        PICK=True, num_warps=4, **pdl_launch(logits.device))
    return tokens


_PICK_EMPTY = -(2**63)  # below every packed (score, column): what `picks` holds between launches
_RACE_STATES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _race_state(device: torch.device, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's race scratch (`picks` int64 at _PICK_EMPTY, `arrivals` int32 at 0, one per row), made
    once and left as found by every launch. Launches of one device run one after the other on the stream
    that samples (rank 0's); the CUDA sampler graphs' eager warm-up (largest first) makes it before any
    capture, where it must not be made (a captured allocation would belong to the graph)."""
    state = _RACE_STATES.get(device)
    if state is None or state[0].numel() < rows:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"gumbel_race: {rows} rows need race scratch made before the graph capture")
        size = max(rows, 256)
        state = (torch.full((size,), _PICK_EMPTY, dtype=torch.int64, device=device),
                 torch.zeros(size, dtype=torch.int32, device=device))
        _RACE_STATES[device] = state
    return state


@triton.jit
def _float_key(z):
    """An int32 whose order is the order of the float32 values (-0.0 taken as +0.0)."""
    bits = tl.where(z == 0.0, 0.0, z).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _race_above(base, temp, a, b, vocab, lanes, lo, INCLUSIVE: tl.constexpr, BLOCK: tl.constexpr,
                MUL1: tl.constexpr, MUL2: tl.constexpr, CMUL: tl.constexpr):
    """One row's race (the lowest column on ties) over the tokens whose key is > lo (>= lo if
    INCLUSIVE), with the noise lanes (a, b): a rejection round's redraw and the fallback's draw."""
    best = tl.full((), float("-inf"), tl.float32)
    cand = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        cols = start + lanes
        mask = cols < vocab
        z = tl.div_rn(tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32), temp)
        score = z + _gumbel_from_hash(_column_hash(a, b, cols, MUL1, MUL2, CMUL))
        key = _float_key(z)
        if INCLUSIVE:  # the bisection's cut is an int64 key
            allowed = key.to(tl.int64) >= lo
        else:  # a rejected candidate's int32 key
            allowed = key > lo
        score = tl.where(mask & allowed, score, float("-inf"))
        best, cand = _keep_best(score, cols, vocab, best, cand)
    return cand


@triton.jit
def _row_top(chunk_max, row, num_chunks, CBLOCK: tl.constexpr):
    """A row's largest logits / T, from the round-0 race's per-chunk maxima."""
    offs = tl.arange(0, CBLOCK)
    return tl.max(tl.load(chunk_max + row * num_chunks + offs, mask=offs < num_chunks, other=float("-inf")), axis=0)


@triton.jit
def _row_top_total(chunk_max, chunk_sum, row, num_chunks, CBLOCK: tl.constexpr):
    """A row's largest logits / T and its softmax denominator relative to it, from round 0's per-chunk
    maxima (the race) and sums (its mass pass, already relative to the row's maximum)."""
    offs = tl.arange(0, CBLOCK)
    inside = offs < num_chunks
    top = tl.max(tl.load(chunk_max + row * num_chunks + offs, mask=inside, other=float("-inf")), axis=0)
    return top, tl.sum(tl.load(chunk_sum + row * num_chunks + offs, mask=inside, other=0.0), axis=0)


@triton.jit
def _row_candidate(race_scores, race_cols, row, num_chunks, CBLOCK: tl.constexpr):
    """The column a whole-row race would pick from its chunks' winners: the best score, the lowest
    column on ties (each chunk's winner is its lowest tied column)."""
    offs = tl.arange(0, CBLOCK)
    inside = offs < num_chunks
    scores = tl.load(race_scores + row * num_chunks + offs, mask=inside, other=float("-inf"))
    cols = tl.load(race_cols + row * num_chunks + offs, mask=inside, other=0)
    best = tl.max(scores, axis=0)
    return tl.min(tl.where(inside & (scores == best), cols, 1 << 62), axis=0)


@triton.jit
def _row_sum(values, row, num_chunks, CBLOCK: tl.constexpr):
    offs = tl.arange(0, CBLOCK)
    return tl.sum(tl.load(values + row * num_chunks + offs, mask=offs < num_chunks, other=0.0), axis=0)


@triton.jit
def _nucleus_mass_kernel(logits, temps, stride_row, vocab, num_chunks, race_scores, race_cols, chunk_max, chunk_sum,
                         mass, done_round, ROUND0: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                         CBLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """One program per (row, chunk) of an undecided row: the chunk's share of the mass of tokens
    likelier than the row's candidate of this round (relative to the row's maximum). ROUND0 (every row
    undecided): also the chunk's whole softmax mass, from the same exponentials (the race before it only
    found the chunks' maxima: summing there, before the row's maximum is known, cost it an online rescale)."""
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    row = tl.program_id(0).to(tl.int64)
    # the chunks in the reverse of the race's launch order: the first programs read the columns the race
    # before read last, which are still in L2 (at 129 rows the float32 logits are 78 MB, the H200's L2 50 MB)
    chunk = num_chunks - 1 - tl.program_id(1)
    undecided = True
    if not ROUND0:
        undecided = tl.load(done_round + row) < 0
    if undecided:
        base = logits + row * stride_row
        temp = tl.load(temps + row)
        cand = _row_candidate(race_scores, race_cols, row, num_chunks, CBLOCK)
        cand_key = _float_key(tl.div_rn(tl.load(base + cand).to(tl.float32), temp))
        top = _row_top(chunk_max, row, num_chunks, CBLOCK)
        shift = tl.where(top == float("-inf"), 0.0, top)  # a row of -inf logits only: no mass anywhere
        acc = tl.zeros((BLOCK,), tl.float32)
        every = tl.zeros((BLOCK,), tl.float32)
        for offset in range(0, CHUNK, BLOCK):
            cols = chunk * CHUNK + offset + tl.arange(0, BLOCK)
            mask = cols < vocab
            z = tl.div_rn(tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32), temp)
            e = tl.where(mask, tl.exp(z - shift), 0.0)
            acc += tl.where(_float_key(z) > cand_key, e, 0.0)
            if ROUND0:
                every += e
        tl.store(mass + row * num_chunks + chunk, tl.sum(acc, axis=0))
        if ROUND0:
            tl.store(chunk_sum + row * num_chunks + chunk, tl.sum(every, axis=0))


@triton.jit
def _nucleus_round_kernel(logits, temps, top_ps, seeds, counters, out, prev_done, done_round, stride_row, vocab,
                          num_chunks, prev_scores, prev_cols, chunk_max, chunk_sum, mass, race_scores, race_cols, rnd,
                          CHUNK: tl.constexpr, BLOCK: tl.constexpr, CBLOCK: tl.constexpr, MUL1: tl.constexpr,
                          MUL2: tl.constexpr, A0: tl.constexpr, B0: tl.constexpr, CMUL: tl.constexpr,
                          USE_PDL: tl.constexpr):
    """Rejection round `rnd` >= 1, one program per (row, chunk): a row whose last candidate is in
    its nucleus is decided (chunk 0's program writes the token); otherwise the chunk's race, with
    round-`rnd` noise, over the tokens likelier than that rejected candidate.

    The rows' decisions go to `done_round`, never to `prev_done` (what this launch reads): a program
    reading a flag that another program of the same launch writes could see it change between its
    warps, and warps that disagree break the block reductions (seen as a wild load on an H200)."""
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    decided = tl.load(prev_done + row)
    now = decided  # an earlier round's decision carries over
    if decided < 0:
        base = logits + row * stride_row
        temp = tl.load(temps + row)
        top, total = _row_top_total(chunk_max, chunk_sum, row, num_chunks, CBLOCK)
        cand = _row_candidate(prev_scores, prev_cols, row, num_chunks, CBLOCK)
        if _row_sum(mass, row, num_chunks, CBLOCK) < tl.load(top_ps + row) * total:
            if chunk == 0:
                tl.store(out + row, cand)
            now = tl.zeros((), tl.int32) + (rnd - 1)
        else:
            cut = _float_key(tl.div_rn(tl.load(base + cand).to(tl.float32), temp))
            seed = tl.load(seeds + row).to(tl.int64)
            counter = tl.load(counters + row).to(tl.int64)
            a, b = _row_keys(seed, counter, (tl.zeros((), tl.int32) + rnd).to(tl.uint32), MUL1, MUL2, A0, B0)
            best = tl.full((), float("-inf"), tl.float32)
            best_col = tl.full((), 0, tl.int64) + chunk * CHUNK
            for offset in range(0, CHUNK, BLOCK):
                cols = chunk * CHUNK + offset + tl.arange(0, BLOCK)
                mask = cols < vocab
                z = tl.div_rn(tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32), temp)
                score = z + _gumbel_from_hash(_column_hash(a, b, cols, MUL1, MUL2, CMUL))
                score = tl.where(mask & (_float_key(z) > cut), score, float("-inf"))
                best, best_col = _keep_best(score, cols, vocab, best, best_col)
            tl.store(race_scores + row * num_chunks + chunk, best)
            tl.store(race_cols + row * num_chunks + chunk, best_col)
    if chunk == 0:
        tl.store(done_round + row, now)


@triton.jit
def _nucleus_finish_kernel(logits, temps, top_ps, seeds, counters, out, done_round, vocab, stride_row, num_chunks,
                           race_scores, race_cols, chunk_max, chunk_sum, mass,
                           FIRST: tl.constexpr, ROUNDS: tl.constexpr, BLOCK: tl.constexpr, CBLOCK: tl.constexpr,
                           MUL1: tl.constexpr, MUL2: tl.constexpr, A0: tl.constexpr, B0: tl.constexpr,
                           CMUL: tl.constexpr, USE_PDL: tl.constexpr):
    """One program per row still undecided after the chunked rounds 0..FIRST-1 (rare: each round
    rejects with probability <= 1 - top_p): accept round FIRST-1's candidate, or run rounds
    FIRST..ROUNDS-1 in the program and after them the exact nucleus cut by bisection (round ROUNDS
    noise). Every decision is taken on the device; a row never sees another row."""
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    row = tl.program_id(0).to(tl.int64)
    if tl.load(done_round + row) < 0:
        base = logits + row * stride_row
        seed = tl.load(seeds + row).to(tl.int64)
        counter = tl.load(counters + row).to(tl.int64)
        temp = tl.load(temps + row)
        lanes = tl.arange(0, BLOCK)
        top, total = _row_top_total(chunk_max, chunk_sum, row, num_chunks, CBLOCK)
        bound = tl.load(top_ps + row) * total  # token i is in the nucleus iff the mass likelier than it is < bound
        drawn = _row_candidate(race_scores, race_cols, row, num_chunks, CBLOCK)
        done = (_row_sum(mass, row, num_chunks, CBLOCK) < bound).to(tl.int32)
        cut = _float_key(tl.div_rn(tl.load(base + drawn).to(tl.float32), temp))  # keys <= cut: outside
        for rnd in range(FIRST, ROUNDS):
            if done == 0:
                a, b = _row_keys(seed, counter, (tl.zeros((), tl.int32) + rnd).to(tl.uint32), MUL1, MUL2, A0, B0)
                drawn = _race_above(base, temp, a, b, vocab, lanes, cut, False, BLOCK, MUL1, MUL2, CMUL)
                cut = _float_key(tl.div_rn(tl.load(base + drawn).to(tl.float32), temp))
                done = (_mass_above(base, temp, top, vocab, lanes, cut.to(tl.int64), BLOCK) < bound).to(tl.int32)
        if done == 0:
            # the exact cut: the smallest key t with mass(keys > t) < bound. It is a token's key (the mass
            # above t only grows at tokens' keys), and the nucleus is every key >= t. Bisection between
            # the last rejected candidate's key (mass above it >= bound) and the maximum's (mass above 0):
            # at most 32 halvings, each a scan of the row, skipped once the bracket is closed.
            lo = cut.to(tl.int64)
            hi = _float_key(top).to(tl.int64)
            for _ in range(32):
                mid = lo + (hi - lo) // 2
                if hi - lo > 1:
                    if _mass_above(base, temp, top, vocab, lanes, mid, BLOCK) < bound:
                        hi = mid
                    else:
                        lo = mid
            a, b = _row_keys(seed, counter, tl.full((), ROUNDS, tl.uint32), MUL1, MUL2, A0, B0)
            drawn = _race_above(base, temp, a, b, vocab, lanes, hi, True, BLOCK, MUL1, MUL2, CMUL)
        tl.store(out + row, drawn)


@triton.jit
def _mass_above(base, temp, top, vocab, lanes, cut, BLOCK: tl.constexpr):
    """One row's softmax mass (relative to its maximum `top`) of the tokens whose key is > cut."""
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + lanes
        mask = cols < vocab
        z = tl.div_rn(tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32), temp)
        acc += tl.where(mask & (_float_key(z).to(tl.int64) > cut), tl.exp(z - top), 0.0)
    return tl.sum(acc, axis=0)


NUCLEUS_BLOCK = 2048  # columns per iteration of the finishing kernel's whole-row scans (one program per row)
# (columns per iteration, warps) of the chunked passes: round 0's mass pass, whose programs all scan, and the
# later rounds' race and mass passes, where only the rejected rows' programs scan (launch/bench/bench_nucleus.py)
NUCLEUS_MASS_TILE = (BLOCK, 4)
NUCLEUS_ROUND_TILE = (BLOCK, 4)
NUCLEUS_CHUNKED_ROUNDS = 3  # rounds 0.. spread over (row, chunk) programs; the rest run a program per row


def nucleus_sample(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor, seeds: torch.Tensor,
                   counters: torch.Tensor, rounds: int, chunked_rounds: int = NUCLEUS_CHUNKED_ROUNDS) -> torch.Tensor:
    """Exact top-p draws (top_p in (0, 1)) without a host sync or a sort: `rounds` rejection rounds
    (round r: the row's (seed, counter, r) noise), then the exact nucleus by bisection and round
    `rounds` noise. The same algorithm as the sampler's torch path (`spmd_engine.executor.sampler._sample_nucleus`),
    token for token up to summation rounding at the nucleus boundary. logits [N, V] (last dim
    contiguous), temperatures / top_ps [N] float32, seeds / counters [N] int64 -> [N] int64.

    Cost: every scan of the first `chunked_rounds` rounds is spread over (row, chunk) programs, as
    the plain race is: round 0 is that race (with each chunk's maximum), then one chunked pass for
    the mass likelier than the candidate and the row's softmax sum; each further round is a chunked race over
    the still-allowed tokens and a chunked mass pass, where decided rows' programs return at once.
    A whole row scanned by one program is far slower (one SM for 150k logits, several times per
    rejected row), so that only serves rows rejected `chunked_rounds` times, with probability <=
    (1 - top_p) ** chunked_rounds (1.25e-4 at top_p 0.95): the rounds left, then the bisection (up
    to 32 scans), reached with probability <= (1 - top_p) ** rounds (1.6e-8 at 0.95 and 6 rounds).
    Each round rejects with probability <= 1 - top_p (the allowed set always holds the nucleus).
    Whatever one row needs, the others neither wait for the host nor see it."""
    _check_nucleus_args(logits, temperatures, top_ps, seeds, counters, rounds, chunked_rounds)
    rows, vocab = logits.shape
    out = torch.empty(rows, device=logits.device, dtype=torch.int64)
    if rows and vocab:
        _launch_nucleus(logits, temperatures.float().contiguous(), top_ps.float().contiguous(),
                        seeds.long().contiguous(), counters.long().contiguous(), out, rounds,
                        min(chunked_rounds, rounds))
    return out


def _check_nucleus_args(logits, temperatures, top_ps, seeds, counters, rounds: int, chunked_rounds: int) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"nucleus_sample: logits must be [N, V] with a contiguous last dim, got {tuple(logits.shape)}")
    rows = logits.shape[0]
    for name, t in (("temperatures", temperatures), ("top_ps", top_ps), ("seeds", seeds), ("counters", counters)):
        if t.shape != (rows,):
            raise ValueError(f"nucleus_sample: {name} must be [{rows}], got {tuple(t.shape)}")
    if not 1 <= rounds < 2**31:
        raise ValueError(f"nucleus_sample: rounds must be in [1, 2**31), got {rounds}")
    if not 1 <= chunked_rounds:
        raise ValueError(f"nucleus_sample: chunked_rounds must be >= 1, got {chunked_rounds}")


def _launch_nucleus(logits, temperatures, top_ps, seeds, counters, out, rounds: int, chunked_rounds: int) -> None:
    """The launches of `nucleus_sample` (its arguments checked, converted and non-empty)."""
    rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, RACE_CHUNK)
    cblock = triton.next_power_of_2(num_chunks)
    # Rows padded to a multiple of 4 in the buffers below: each slice [k] then starts 16-byte aligned
    # whatever the row count, as Triton specialises a kernel per pointer alignment (an odd row count
    # compiled new variants mid-job, ~70 ms each on an H200).
    padded = -(-rows // 4) * 4
    # float32 [5, N, chunks]: two races' chunk winners (rounds alternate), chunk maxima, sums, masses
    stats = torch.empty(5, padded, num_chunks, device=logits.device, dtype=torch.float32)
    race_cols = torch.empty(2, padded, num_chunks, device=logits.device, dtype=torch.int64)
    # per row, the round its candidate was accepted in (-1: undecided); rounds alternate between two
    # copies, so a launch only reads what an earlier launch wrote
    done = torch.empty(2, padded, device=logits.device, dtype=torch.int32)
    chunk_max, chunk_sum, mass = stats[2], stats[3], stats[4]
    hashing = dict(MUL1=HASH_MUL1, MUL2=HASH_MUL2, A0=LANE_A, B0=LANE_B, CMUL=COLUMN_MUL)
    pdl = pdl_launch(logits.device)  # every launch below (kernels/pdl.py)
    grid = (rows, num_chunks)
    stride = logits.stride(0)
    _gumbel_race_kernel[grid](  # round 0, spread over the GPU
        logits, temperatures, seeds, counters, stats[0], race_cols[0], vocab, stride, num_chunks,
        chunk_max, done[0], race_cols[0], done[0], race_cols[0], 0,  # the PICK arguments: unread
        CHUNK=RACE_CHUNK, BLOCK=BLOCK, WITH_STATS=True, num_warps=4, **hashing, **pdl)
    mass_block, mass_warps = NUCLEUS_MASS_TILE
    round_block, round_warps = NUCLEUS_ROUND_TILE
    _nucleus_mass_kernel[grid](logits, temperatures, stride, vocab, num_chunks, stats[0], race_cols[0], chunk_max,
                               chunk_sum, mass, done[0], ROUND0=True, CHUNK=RACE_CHUNK, BLOCK=mass_block,
                               CBLOCK=cblock, num_warps=mass_warps, **pdl)
    for rnd in range(1, chunked_rounds):
        prev, cur = (rnd - 1) % 2, rnd % 2
        _nucleus_round_kernel[grid](
            logits, temperatures, top_ps, seeds, counters, out, done[prev], done[cur], stride, vocab, num_chunks,
            stats[prev], race_cols[prev], chunk_max, chunk_sum, mass, stats[cur], race_cols[cur], rnd,
            CHUNK=RACE_CHUNK, BLOCK=round_block, CBLOCK=cblock, num_warps=round_warps, **hashing, **pdl)
        _nucleus_mass_kernel[grid](logits, temperatures, stride, vocab, num_chunks, stats[cur], race_cols[cur],
                                   chunk_max, chunk_sum, mass, done[cur], ROUND0=False, CHUNK=RACE_CHUNK,
                                   BLOCK=round_block, CBLOCK=cblock, num_warps=round_warps, **pdl)
    last = (chunked_rounds - 1) % 2
    _nucleus_finish_kernel[(rows,)](
        logits, temperatures, top_ps, seeds, counters, out, done[last], vocab, stride, num_chunks,
        stats[last], race_cols[last], chunk_max, chunk_sum, mass,
        FIRST=chunked_rounds, ROUNDS=rounds, BLOCK=NUCLEUS_BLOCK, CBLOCK=cblock, num_warps=8, **hashing, **pdl)
