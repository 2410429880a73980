"""Triton top-k sampling (with top-p inside the top-k): the sampler's top-k draw in two launches.

Why: `torch.topk` over [256, 151936] logits is a radix select of several launches, and the torch path
around it (`executor/sampler._sample_top_k`) adds a dozen small launches and two host-to-device copies
per step: `workload.top_k=20` (Qwen3's default) ran 9 % below the plain race on an H200 nano bench.
Here the keys are device tensors (a CUDA graph can replay the draw) and the vocabulary is read once.

1. `_candidates_kernel`, one program per (row, chunk of CHUNK columns): a superset of the chunk's k
   largest logits. The k-th largest of the chunk's GROUPS group maxima (found by bisection on the
   logits' order-preserving int32 keys) is a lower bound of the chunk's k-th largest logit (k distinct
   logits reach it), so every logit >= it is kept: about k of them for
   k << GROUPS. The survivors are compacted into the row's scratch (at most CAP per chunk); a chunk
   with more (ties, structured logits) takes its exact top k by k rounds of max extraction instead.
2. `_draw_kernel`, one program per row: the row's k best candidates by (logit, lowest column), in rank
   order, each divided by T (a true division); the nucleus within the renormalised top-k from fixed-point
   weights trunc(exp(z - z_max) * 2**52) (float64 exp, int64 sums: exact in any order), a rank kept when
   the mass before it is < top_p * the top-k's mass (as float64; top_p >= 1 keeps all); then the Gumbel
   race over the kept candidates with the round-0 noise of their original columns
   (`sampling_noise._column_hash`) added in one IEEE rounding (`_add_rn`: no FMA, no flush), ties to the
   lowest column.

Exactness: the draw is `reference.top_k_sample_reference` and `sampler._sample_top_k` token for token,
ties included (tied logits rank lowest column first, at the k-th rank as at the nucleus cut; -0.0 ties
+0.0). The only arithmetic that is each device's own is the float64 exp (libdevice's here, torch's
there): a one-ulp difference moves a weight by at most one 2**-52 unit, which decides a token only if the
cut falls within that of a rank's mass. The noise's log is the hardware's, as in every noise kernel (the
torch path's noise comes from `sampling_noise.gumbel_noise_at`, the same code). A row's token depends on
its own logits and keys only: not on `k_cap`, the chunking or the other rows. Rows whose temperature is
0 are skipped (their token left as it was): a sampler graph's padding rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import libdevice

from spmd_engine.kernels.pdl import pdl_launch, pdl_prologue, triton_interpreting
from spmd_engine.kernels.reference import COLUMN_MUL, HASH_MUL1, HASH_MUL2, LANE_A, LANE_B, NUCLEUS_MASS_ONE
from spmd_engine.kernels.sampling_noise import _column_hash, _float_key, _gumbel_from_hash, _row_keys

GROUP = 16  # columns per group of the candidate bound
GROUPS = 256  # groups per chunk: the bound is tight for k << GROUPS
CHUNK = GROUP * GROUPS  # columns per program of the candidate pass (as the plain race's chunks)
K_CAPS = (32, 128)  # the compiled row capacities (k_cap): two variants, whatever k a job asks for
TOP_K_KERNEL_MAX = K_CAPS[-1]  # rows with a larger k take the torch path
_NO_COLUMN = tl.constexpr(2**31 - 1)  # no candidate (past every column)
_TAKEN = tl.constexpr(-(2**63))  # a packed candidate already ranked (below every real one)
_LIBDEVICE = tl.constexpr(not triton_interpreting())  # the interpreter has no libdevice


def k_cap_for(max_k: int) -> int:
    """The smallest compiled capacity holding rows of top_k up to `max_k` (<= TOP_K_KERNEL_MAX)."""
    for cap in K_CAPS:
        if max_k <= cap:
            return cap
    raise ValueError(f"top_k_sample: k {max_k} is past the kernel's largest capacity {TOP_K_KERNEL_MAX}")


def _slots(k_cap: int) -> int:
    return 2 * k_cap  # candidates a chunk may keep before it takes the exact rounds


def scratch_numel(rows: int, vocab: int, k_cap: int) -> int:
    """int32 words of the candidate scratch for `rows` rows (`top_k_sample`'s `scratch`)."""
    cells = -(-rows * triton.cdiv(vocab, CHUNK) // 4) * 4  # 16-byte aligned sections
    return cells * (1 + 2 * _slots(k_cap))


def make_scratch(rows: int, vocab: int, k_cap: int, device: torch.device) -> torch.Tensor:
    return torch.empty(scratch_numel(rows, vocab, k_cap), dtype=torch.int32, device=device)


@triton.jit
def _exp64(x):
    if _LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _add_rn(x, y):
    """float32 x + y rounded once, subnormals kept, as torch's add: a plain add may be fused with the
    multiply that ends the noise's log (`fast_logf`) into an FMA (which rounds once less), and
    libdevice's add_rn flushes subnormals to zero. An explicit `add.rn.f32` is neither."""
    if _LIBDEVICE:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return x + y


@triton.jit
def _key_float(key):
    """`_float_key`'s inverse (-0.0 comes back as +0.0)."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _kth_largest(keys, k):
    """The k-th largest of int32 `keys` (k <= their count) by bisection: the largest t with at least k
    keys >= t (a sort costs more, and its bitonic network is slow in the interpreter)."""
    lo = tl.min(keys, axis=0).to(tl.int64)  # every key is >= lo
    hi = tl.max(keys, axis=0).to(tl.int64) + 1  # none is >= hi
    for _ in range(33):
        mid = lo + (hi - lo) // 2
        enough = tl.sum((keys.to(tl.int64) >= mid).to(tl.int32), axis=0) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    return lo.to(tl.int32)


@triton.jit
def _candidates_kernel(logits, temps, top_ks, cand_n, cand_x, cand_col, vocab, stride_row, num_chunks,
                       K_CAP: tl.constexpr, SLOTS: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """A superset of the chunk's k best logits (finite ones only) into its scratch slots, and their count."""
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if tl.load(temps + row) != 0.0:  # temperature 0: a sampler graph's padding row
        k = tl.minimum(tl.maximum(tl.load(top_ks + row), 1), K_CAP).to(tl.int32)
        cols = chunk * (GROUPS * GROUP) + tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        x = tl.load(logits + row * stride_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        keys = _float_key(x)
        bound = _kth_largest(tl.max(keys, axis=1), k)
        keep = (keys >= bound) & (x > float("-inf"))
        flags = keep.to(tl.int32)
        per_group = tl.sum(flags, axis=1)
        total = tl.sum(per_group, axis=0)
        slot = (tl.cumsum(per_group, axis=0) - per_group)[:, None] + tl.cumsum(flags, axis=1) - 1
        cell = row * num_chunks + chunk
        base = cell * SLOTS
        if total <= SLOTS:
            tl.store(cand_x + base + slot, x, mask=keep)
            tl.store(cand_col + base + slot, cols, mask=keep)
            tl.store(cand_n + cell, total)
        else:  # too many reach the bound: the chunk's exact top k, one extraction per rank
            live = tl.where(keep, x, float("-inf"))
            found = tl.zeros((), tl.int32)
            for i in range(0, k):
                best = tl.max(tl.max(live, axis=1), axis=0)
                col = tl.min(tl.min(tl.where(live == best, cols, _NO_COLUMN), axis=1), axis=0)
                real = best > float("-inf")
                tl.store(cand_x + base + i, best, mask=real)
                tl.store(cand_col + base + i, col, mask=real)
                live = tl.where(cols == col, float("-inf"), live)
                found += real.to(tl.int32)
            tl.store(cand_n + cell, found)


@triton.jit
def _draw_kernel(temps, top_ks, top_ps, seeds, counters, cand_n, cand_x, cand_col, tokens, num_chunks,
                 K_CAP: tl.constexpr, SLOTS: tl.constexpr, CBLOCK: tl.constexpr, MUL1: tl.constexpr,
                 MUL2: tl.constexpr, A0: tl.constexpr, B0: tl.constexpr, CMUL: tl.constexpr, MASS_ONE: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """One row: its k best candidates in rank order, the nucleus inside them, the race over the kept."""
    pdl_prologue(USE_PDL)  # kernels/pdl.py: before any memory access
    row = tl.program_id(0).to(tl.int64)
    temp = tl.load(temps + row)
    if temp != 0.0:
        k = tl.minimum(tl.maximum(tl.load(top_ks + row), 1), K_CAP).to(tl.int32)
        chunks = tl.arange(0, CBLOCK)[:, None]
        slots = tl.arange(0, SLOTS)[None, :]
        count = tl.load(cand_n + row * num_chunks + chunks, mask=chunks < num_chunks, other=0)
        at = (row * num_chunks + chunks) * SLOTS + slots
        x = tl.load(cand_x + at, mask=slots < count, other=float("-inf"))
        col = tl.load(cand_col + at, mask=slots < count, other=_NO_COLUMN)
        ranks = tl.arange(0, K_CAP)
        z_ranked = tl.full((K_CAP,), float("-inf"), tl.float32)
        col_ranked = tl.full((K_CAP,), _NO_COLUMN, tl.int32)
        before = tl.zeros((K_CAP,), tl.int64)  # mass of the better ranks (fixed point, as the torch path)
        mass = tl.zeros((), tl.int64)
        z_top = tl.zeros((), tl.float64)
        # (logit key, lowest column) packed in one int64: each rank is one max reduction
        packed = (_float_key(x).to(tl.int64) << 32) | (2**31 - 1 - col.to(tl.int64))  # 2**31 - 1: _NO_COLUMN
        for i in range(0, k):
            top = tl.max(tl.max(packed, axis=1), axis=0)
            packed = tl.where(packed == top, _TAKEN, packed)
            pick = (2**31 - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
            best = _key_float((top >> 32).to(tl.int32))
            real = best > float("-inf")
            z = tl.div_rn(best, temp)
            z_top = tl.where(i == 0, z.to(tl.float64), z_top)
            shifted = tl.where(real, z.to(tl.float64) - z_top, float("-inf"))
            weight = (_exp64(shifted) * MASS_ONE).to(tl.int64)  # truncated, as torch's .long()
            here = ranks == i
            before = tl.where(here, mass, before)
            z_ranked = tl.where(here, z, z_ranked)
            col_ranked = tl.where(here, tl.where(real, pick, _NO_COLUMN), col_ranked)
            mass += weight
        top_p = tl.load(top_ps + row)
        cut = tl.where(top_p < 1.0, top_p * mass.to(tl.float64), float("inf"))
        kept = (col_ranked != _NO_COLUMN) & (before.to(tl.float64) < cut)
        a, b = _row_keys(tl.load(seeds + row).to(tl.int64), tl.load(counters + row).to(tl.int64),
                         tl.full((), 0, tl.uint32), MUL1, MUL2, A0, B0)
        score = _add_rn(z_ranked, _gumbel_from_hash(_column_hash(a, b, col_ranked, MUL1, MUL2, CMUL)))
        score = tl.where(kept, score, float("-inf"))
        top = tl.max(score, axis=0)
        token = tl.min(tl.where(kept & (score == top), col_ranked, _NO_COLUMN), axis=0)
        tl.store(tokens + row, tl.where(token == _NO_COLUMN, 0, token).to(tl.int64))  # no finite logit: 0


_SCRATCH: dict[tuple[torch.device, int], torch.Tensor] = {}


def _eager_scratch(device: torch.device, rows: int, vocab: int, k_cap: int) -> torch.Tensor:
    """The eager draws' scratch per (device, capacity), grown as needed (a sampler graph brings its own:
    a captured pointer must outlive every replay)."""
    need = scratch_numel(rows, vocab, k_cap)
    scratch = _SCRATCH.get((device, k_cap))
    if scratch is None or scratch.numel() < need:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("top_k_sample: pass a scratch made before the graph capture")
        scratch = make_scratch(max(rows, 256), vocab, k_cap, device)
        _SCRATCH[(device, k_cap)] = scratch
    return scratch


def top_k_sample(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                 seeds: torch.Tensor, counters: torch.Tensor, k_cap: int, out: torch.Tensor | None = None,
                 scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k (and top-p within it) draws: logits [N, V] (last dim contiguous; float32, bf16 or fp16, raced
    as their float32 values), temperatures [N] float32 (> 0; 0: the row is skipped), top_ks [N] int64 in
    [1, k_cap] (a larger k is taken as k_cap: the caller picks `k_cap_for` its largest), top_ps [N] float64,
    seeds / counters [N] int64 -> [N] int64 (`out` if given). `scratch`: int32 of at least
    `scratch_numel(N, V, k_cap)` words (None: a per-device one)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"top_k_sample: logits must be [N, V] with a contiguous last dim, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    for name, t, dtype in (("temperatures", temperatures, torch.float32), ("top_ks", top_ks, torch.int64),
                           ("top_ps", top_ps, torch.float64), ("seeds", seeds, torch.int64),
                           ("counters", counters, torch.int64)):
        if t.shape != (rows,) or t.dtype != dtype:
            raise ValueError(f"top_k_sample: {name} must be {dtype} [{rows}], got {t.dtype} {tuple(t.shape)}")
    if k_cap not in K_CAPS:
        raise ValueError(f"top_k_sample: k_cap must be one of {K_CAPS}, got {k_cap}")
    if out is not None and (out.shape != (rows,) or out.dtype != torch.int64 or not out.is_contiguous()):
        raise ValueError(f"top_k_sample: out must be a contiguous int64 [{rows}], got {tuple(out.shape)} {out.dtype}")
    tokens = torch.empty(rows, device=logits.device, dtype=torch.int64) if out is None else out
    if not rows or not vocab:
        return tokens.zero_()
    if scratch is None:
        scratch = _eager_scratch(logits.device, rows, vocab, k_cap)
    elif scratch.dtype != torch.int32 or scratch.numel() < scratch_numel(rows, vocab, k_cap):
        raise ValueError(f"top_k_sample: scratch must be int32 of at least {scratch_numel(rows, vocab, k_cap)} words")
    num_chunks = triton.cdiv(vocab, CHUNK)
    slots = _slots(k_cap)
    cells = -(-rows * num_chunks // 4) * 4
    cand_n = scratch[:cells]
    cand_x = scratch[cells:cells * (1 + slots)].view(torch.float32)
    cand_col = scratch[cells * (1 + slots):cells * (1 + 2 * slots)]
    temps, seeds, counters = temperatures.contiguous(), seeds.contiguous(), counters.contiguous()
    top_ks, top_ps = top_ks.contiguous(), top_ps.contiguous()
    pdl = pdl_launch(logits.device)
    _candidates_kernel[(rows, num_chunks)](
        logits, temps, top_ks, cand_n, cand_x, cand_col, vocab, logits.stride(0), num_chunks,
        K_CAP=k_cap, SLOTS=slots, GROUPS=GROUPS, GROUP=GROUP, num_warps=4, **pdl)
    _draw_kernel[(rows,)](
        temps, top_ks, top_ps, seeds, counters, cand_n, cand_x, cand_col, tokens, num_chunks,
        K_CAP=k_cap, SLOTS=slots, CBLOCK=triton.next_power_of_2(num_chunks), MUL1=HASH_MUL1, MUL2=HASH_MUL2,
        A0=LANE_A, B0=LANE_B, CMUL=COLUMN_MUL, MASS_ONE=NUCLEUS_MASS_ONE,
        num_warps=4 if k_cap <= 32 else 16, **pdl)
    return tokens
