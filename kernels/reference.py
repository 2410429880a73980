"""Plain-torch oracles for the KV-cache write and paged attention.

They are the CPU path of the engine and the ground truth the Triton kernels are tested against.
KV cache layout (every backend): [num_blocks, block_size, num_kv_heads, head_dim].
"""
from __future__ import annotations

import torch


def store_kv_reference(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int; -1 = padding, skipped
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def gather_kv_reference(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first `seq_len` cached positions of one sequence: [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention_reference(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B]
    block_tables: torch.Tensor,  # [B, max_blocks]
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context (GQA aware).

    Accumulates in float32 and returns query.dtype. The mask is aligned lower-right: query i of a
    sequence with q_len new tokens and seq_len keys sees keys 0 .. seq_len - q_len + i.
    """
    out = torch.empty_like(query)
    num_q_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        start, end, seq_len = cu[b], cu[b + 1], lens[b]
        q_len = end - start
        if q_len == 0:
            continue
        q = query[start:end].float().transpose(0, 1)  # [Hq, q, D]
        k = gather_kv_reference(k_cache, block_tables[b], seq_len).float()
        v = gather_kv_reference(v_cache, block_tables[b], seq_len).float()
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, S, D]
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [Hq, q, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] > q_pos[:, None]
        scores.masked_fill_(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(probs, v).transpose(0, 1).to(query.dtype)
    return out


# --- counter-based sampling noise ------------------------------------------------------------
# A row's noise is a pure function of (seed, counter, round, column): no generator state, so a
# request's draws cannot depend on which other rows share its batch or how steps were scheduled.
# kernels/sampling_noise.py computes the same 32-bit hash in Triton (uint32 arithmetic); here it is
# int64 arithmetic masked to 32 bits, and both must agree bit for bit.

MASK32 = 0xFFFFFFFF
HASH_MUL1, HASH_MUL2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3's 32-bit finalizer
LANE_A, LANE_B = 0x6A09E667, 0xBB67AE85  # start values of the two row-key lanes
COLUMN_MUL = 0x9E3779B1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) without int64 overflow (two 16-bit halves of c)."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, HASH_MUL1)
    h = h ^ (h >> 13)
    h = _mul32(h, HASH_MUL2)
    return h ^ (h >> 16)


def sampling_row_keys_reference(seeds: torch.Tensor, counters: torch.Tensor, round_: int
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit lanes per row (int64 in [0, 2**32)) from the full 64-bit seed, the counter and the
    round: the lanes absorb the parts in opposite orders, so rows collide only if both lanes do."""
    seeds, counters = seeds.long(), counters.long()
    seed_lo, seed_hi = seeds & MASK32, (seeds >> 32) & MASK32
    ctr_lo, ctr_hi = counters & MASK32, (counters >> 32) & MASK32
    rnd = round_ & MASK32
    a = _fmix32(seed_lo ^ LANE_A)
    for part in (seed_hi, ctr_lo, ctr_hi, rnd):
        a = _fmix32(a ^ part)
    b = _fmix32(torch.full_like(seeds, (rnd + LANE_B) & MASK32))
    for part in (ctr_hi, ctr_lo, seed_hi, seed_lo):
        b = _fmix32((b + part) & MASK32)
    return a, b


def sampling_hash_reference(seeds: torch.Tensor, counters: torch.Tensor, round_: int, vocab: int) -> torch.Tensor:
    """seeds [N] int64 (a uint64 seed's bits), counters [N] int64 -> [N, vocab] int64 in [0, 2**32).
    For a fixed row the map column -> hash is a bijection (every step of it is)."""
    a, b = sampling_row_keys_reference(seeds, counters, round_)
    cols = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :]
    inner = _fmix32((_mul32(cols, COLUMN_MUL) + b[:, None]) & MASK32)
    return _fmix32(inner ^ a[:, None])


def gumbel_from_hash_reference(bits: torch.Tensor) -> torch.Tensor:
    """32 random bits -> Gumbel noise G = -log(E), E ~ Exp(1), float32.

    v = (bits + 1/2) / 2**32 in (0, 1) keeps full resolution near 0, where E = -log(1 - v) ~ v is
    small and decides the race; a short series replaces log(1 - v) there (1 - v would round)."""
    v = bits.to(torch.float32) * 2.0**-32 + 2.0**-33
    v = torch.clamp(v, max=1.0 - 2.0**-24)  # bits near 2**32 round up to 1.0 in float32
    series = v * (1.0 + v * (0.5 + v * (1.0 / 3.0 + v * 0.25)))
    e = torch.where(v < 2.0**-6, series, -torch.log(1.0 - v))
    return -torch.log(e)


def gumbel_noise_reference(seeds: torch.Tensor, counters: torch.Tensor, round_: int, vocab: int) -> torch.Tensor:
    """[N, vocab] float32 Gumbel noise: argmax(logits / T + noise) draws from softmax(logits / T)."""
    return gumbel_from_hash_reference(sampling_hash_reference(seeds, counters, round_, vocab))
