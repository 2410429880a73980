"""Plain-torch oracles for the KV-cache write (alone and after the q/k norm + rotary it is fused with),
paged attention, the small-batch GEMV, the sampling-noise hash and the deferred input ids' feed.

They are the CPU path of the engine and the ground truth the Triton kernels are tested against.
KV cache layout (every backend): [num_blocks, block_size, num_kv_heads, head_dim]. A
float8_e4m3fn cache comes with per-KV-head scales (`kernels/kv_quant.py`): written quantized,
upcast to float32 and multiplied by its scale on read; its V blocks store positions in pairs
(`kv_quant.FP8_V_LAYOUT`).
"""
from __future__ import annotations

import numpy as np
import torch

from spmd_engine.kernels.kv_quant import check_kv_scales, quantize_fp8_reference, read_v_blocks, write_v_positions


def feed_tokens_reference(input_ids: torch.Tensor, feed_rows: torch.Tensor, feed: torch.Tensor) -> None:
    """In place: input_ids[i] = feed[feed_rows[i]] wherever feed_rows[i] >= 0 (kernels/feed_tokens.py)."""
    fed = feed_rows >= 0
    input_ids[fed] = feed[feed_rows[fed]]


def store_kv_reference(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int; -1 = padding, skipped
    k_scale: torch.Tensor | None = None,  # [Hkv] float32, only with a float8_e4m3fn cache
    v_scale: torch.Tensor | None = None,
) -> None:
    fp8 = check_kv_scales("store_kv_reference", k_cache, k_scale, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    if fp8:
        k_cache[blocks, offsets] = quantize_fp8_reference(key[keep], k_scale)
        write_v_positions(v_cache, blocks, offsets, quantize_fp8_reference(value[keep], v_scale))
        return
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def qk_norm_rope_store_reference(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, D/2]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int; -1 = padding, skipped
    q_weight: torch.Tensor | None = None,  # [D] per-head RMSNorm weights (Qwen3); None: no norm
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The chain `kernels/qk_norm_rope_store.py` fuses, op by op: per-head RMSNorm (float32, rounded to the
    input dtype before the weight, as models/layers/norm.py), rotate-half rotary in float32 rounded once
    (as kernels/rotary.py), then `store_kv_reference` of the rotated k and v. Returns the rotated q."""

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return (normed.float() * weight.float()).to(x.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos.float()[:, None], sin.float()[:, None]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    if q_weight is not None:
        q, k = norm(q, q_weight), norm(k, k_weight)
    q, k = rotate(q), rotate(k)
    store_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def gather_kv_reference(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, fp8_v: bool = False
) -> torch.Tensor:
    """The first `seq_len` cached positions of one sequence: [seq_len, Hkv, D]. `fp8_v`: `cache` is an
    fp8 V cache (pairs of positions)."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    gathered = read_v_blocks(cache, blocks) if fp8_v else cache[blocks]
    return gathered.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention_reference(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B]
    block_tables: torch.Tensor,  # [B, max_blocks]
    scale: float,
    k_scale: torch.Tensor | None = None,  # [Hkv] float32, only with a float8_e4m3fn cache
    v_scale: torch.Tensor | None = None,
    window: int = 0,  # > 0: a sliding window, each query sees its last `window` positions (itself included)
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context (GQA aware).

    Accumulates in float32 and returns query.dtype; an fp8 cache is dequantized on read. The mask is
    aligned lower-right: query i of a sequence with q_len new tokens and seq_len keys sees keys
    0 .. seq_len - q_len + i; with a `window` W only keys above its position - W (HF's sliding window).
    """
    fp8 = check_kv_scales("paged_attention_reference", k_cache, k_scale, v_scale)
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
        v = gather_kv_reference(v_cache, block_tables[b], seq_len, fp8_v=fp8).float()
        if fp8:
            k = k * k_scale[None, :, None]
            v = v * v_scale[None, :, None]
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, S, D]
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [Hq, q, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] > q_pos[:, None]
        if window > 0:
            mask |= k_pos[None, :] <= q_pos[:, None] - window
        scores.masked_fill_(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(probs, v).transpose(0, 1).to(query.dtype)
    return out


def linear_reference(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,  # None: x.dtype
) -> torch.Tensor:
    """x @ weight^T (+ bias) summed in float64 and rounded once to `out_dtype`: the oracle of
    `kernels/gemv.py` (which sums in float32, so the two agree to float32 rounding)."""
    y = x.double() @ weight.double().t()
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype or x.dtype)


# --- counter-based sampling noise ------------------------------------------------------------
# A row's noise is a pure function of (seed, counter, round, column): no generator state, so a
# request's draws cannot depend on which other rows share its batch or how steps were scheduled.
# kernels/sampling_noise.py computes the same 32-bit hash in Triton; here it is numpy uint32
# arithmetic (wrapping mod 2**32 by definition, and ~20x faster on CPU than masked int64 torch ops),
# and both must agree bit for bit.

HASH_MUL1, HASH_MUL2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3's 32-bit finalizer
LANE_A, LANE_B = 0x6A09E667, 0xBB67AE85  # start values of the two row-key lanes
COLUMN_MUL = 0x9E3779B1
# the top-k nucleus weights' fixed-point unit: exp(z - z_max) <= 1 as an int64 count of 2**-52, so the
# masses are exact integer sums, the same whatever order a device sums them in (1024 ranks: < 2**62)
NUCLEUS_MASS_ONE = float(2**52)


def _fmix32(h: np.ndarray) -> np.ndarray:
    """murmur3's finalizer on a uint32 array, in place (a bijection with full avalanche)."""
    h ^= h >> np.uint32(16)
    h *= np.uint32(HASH_MUL1)
    h ^= h >> np.uint32(13)
    h *= np.uint32(HASH_MUL2)
    h ^= h >> np.uint32(16)
    return h


def sampling_row_keys_reference(seeds: torch.Tensor, counters: torch.Tensor, round_: int
                                ) -> tuple[np.ndarray, np.ndarray]:
    """Two 32-bit lanes per row (uint32 [N]) from the full 64-bit seed, the counter and the round:
    the lanes absorb the parts in opposite orders, so rows collide only if both lanes do."""
    seeds = seeds.detach().cpu().long().numpy().view(np.uint64)
    counters = counters.detach().cpu().long().numpy().view(np.uint64)
    low = np.uint64(0xFFFFFFFF)
    seed_lo, seed_hi = (seeds & low).astype(np.uint32), (seeds >> np.uint64(32)).astype(np.uint32)
    ctr_lo, ctr_hi = (counters & low).astype(np.uint32), (counters >> np.uint64(32)).astype(np.uint32)
    rnd = np.uint32(round_ & 0xFFFFFFFF)
    a = _fmix32(seed_lo ^ np.uint32(LANE_A))
    for part in (seed_hi, ctr_lo, ctr_hi):
        a = _fmix32(a ^ part)
    a = _fmix32(a ^ rnd)
    b = _fmix32(np.full(seeds.shape, (int(rnd) + LANE_B) & 0xFFFFFFFF, dtype=np.uint32))
    for part in (ctr_hi, ctr_lo, seed_hi, seed_lo):
        b = _fmix32(b + part)
    return a, b


def _sampling_hash_np(seeds: torch.Tensor, counters: torch.Tensor, round_: int, vocab: int) -> np.ndarray:
    return _column_hash_np(seeds, counters, round_, np.arange(vocab, dtype=np.uint32)[None, :])


def _column_hash_np(seeds: torch.Tensor, counters: torch.Tensor, round_: int, cols: np.ndarray) -> np.ndarray:
    """The hash of each row's columns `cols` ([1, C] for every row alike or [N, C] per row), uint32 [N, C]."""
    a, b = sampling_row_keys_reference(seeds, counters, round_)
    h = cols.astype(np.uint32) * np.uint32(COLUMN_MUL) + b[:, None]
    _fmix32(h)
    h ^= a[:, None]
    return _fmix32(h)


def sampling_hash_reference(seeds: torch.Tensor, counters: torch.Tensor, round_: int, vocab: int) -> torch.Tensor:
    """seeds [N] int64 (a uint64 seed's bits), counters [N] int64 -> [N, vocab] int64 in [0, 2**32)
    on the seeds' device. For a fixed row the map column -> hash is a bijection (every step is)."""
    bits = _sampling_hash_np(seeds, counters, round_, vocab).astype(np.int64)
    return torch.from_numpy(bits).to(seeds.device)


def _gumbel_from_hash_np(bits: np.ndarray) -> np.ndarray:
    """32 random bits (uint32) -> Gumbel noise G = -log(E), E ~ Exp(1), float32.

    v = (bits + 1/2) / 2**32 in (0, 1) keeps full resolution near 0, where E = -log(1 - v) ~ v is
    small and decides the race; a short series replaces log(1 - v) there (1 - v would round)."""
    f32 = np.float32
    v = bits.astype(f32) * f32(2.0**-32) + f32(2.0**-33)
    np.minimum(v, f32(1.0 - 2.0**-24), out=v)  # bits near 2**32 round up to 1.0 in float32
    series = v * (f32(1.0) + v * (f32(0.5) + v * (f32(1.0 / 3.0) + v * f32(0.25))))
    e = np.where(v < f32(2.0**-6), series, -np.log(f32(1.0) - v))
    return -np.log(e)


def gumbel_noise_reference(seeds: torch.Tensor, counters: torch.Tensor, round_: int, vocab: int) -> torch.Tensor:
    """[N, vocab] float32 Gumbel noise on the seeds' device: argmax(logits / T + noise) draws from
    softmax(logits / T). numpy on the host (its float32 log is vectorised; the CPU sampler's path)."""
    return torch.from_numpy(_gumbel_from_hash_np(_sampling_hash_np(seeds, counters, round_, vocab))).to(seeds.device)


def gumbel_noise_at_reference(seeds: torch.Tensor, counters: torch.Tensor, round_: int, cols: torch.Tensor
                              ) -> torch.Tensor:
    """The Gumbel noise of row i at columns cols[i] only ([N, C] int64 -> [N, C] float32 on the seeds'
    device): `gumbel_noise_reference(...).gather(1, cols)` without the [N, vocab] tensor."""
    bits = _column_hash_np(seeds, counters, round_, cols.detach().cpu().numpy())
    return torch.from_numpy(_gumbel_from_hash_np(bits)).to(seeds.device)


def _zero_as_positive(x: torch.Tensor) -> torch.Tensor:
    """-0.0 as +0.0: a sort's order of the two zeros is the order of their bits (the kernel ties them)."""
    return x.masked_fill(x == 0, 0.0)


def top_k_sample_reference(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                           top_ps: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """The top-k draw of `kernels/top_k_sample.py`, op by op: each row's k largest logits (float32) by a
    stable sort (ties to the lowest column, -0.0 taken as +0.0), divided by T (a true division); the nucleus
    within the top-k from fixed-point weights trunc(exp(z - z_max) * NUCLEUS_MASS_ONE) (float64 exp, int64
    sums: exact in any order), a rank kept when the mass before it is < top_p * the top-k's mass (both as
    float64), or top_p >= 1; the race z + round-0 Gumbel noise of each kept column (one float32 add), ties
    to the lowest column. The sampler's torch path (`executor/sampler._sample_top_k`) draws the same token."""
    values, order = _zero_as_positive(logits.float()).sort(dim=-1, descending=True, stable=True)
    tokens = []
    for i in range(logits.shape[0]):
        k = int(top_ks[i])
        z = values[i, :k] / temperatures[i].float().to(values.device)
        cols = order[i, :k]
        shifted = (z.double() - z[0].double()).masked_fill(z == float("-inf"), float("-inf"))
        weights = (shifted.exp() * NUCLEUS_MASS_ONE).long()
        before = weights.cumsum(dim=0) - weights
        p = float(top_ps[i])
        keep = before.double() < (p * float(weights.sum().double()) if p < 1.0 else float("inf"))
        noise = gumbel_noise_at_reference(seeds[i:i + 1], counters[i:i + 1], 0, cols[None, :])[0].to(z.device)
        scores = (z + noise).masked_fill(~keep, float("-inf"))
        tokens.append(int(cols[scores == scores.max()].min()))
    return torch.tensor(tokens, dtype=torch.int64, device=logits.device)


def apply_token_bitmask_reference(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`kernels/token_bitmask.apply_token_bitmask` in torch: logits[rows[i], t] = -inf where bit t % 32 of word
    t // 32 of mask[i] (int32) is 0, for t < min(V, 32 W); in place, returns logits."""
    if mask.shape[0] == 0:
        return logits
    width = min(logits.shape[1], 32 * mask.shape[1])
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = ((mask[:, :, None] >> shifts) & 1).reshape(mask.shape[0], -1)[:, :width]
    index = rows.to(torch.int64)
    picked = logits.index_select(0, index)
    picked[:, :width].masked_fill_(bits == 0, float("-inf"))
    return logits.index_copy_(0, index, picked)


def moe_route_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (float32) over the experts, the k largest, optionally renormalised to sum to 1 ->
    (weights [T, k] float32, expert ids [T, k] int32), as HF's Qwen3-MoE router (`kernels/moe_route.py`)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, first_expert: int = 0, out_dtype: torch.dtype | None = None
                        ) -> torch.Tensor:
    """sum_k weight_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's k experts e = topk_ids[t, k] (global
    ids), for the experts this rank holds: w13 [E_local, 2I, H] (gate rows | up rows), w2 [E_local, H, I] are
    experts first_expert .. first_expert + E_local - 1; other experts add nothing. The activation is rounded to
    x's dtype (as a separate silu_and_mul would), the products and the weighted sum over k stay float32, rounded
    once to `out_dtype` (None: x's dtype). The CPU path of the MoE layer and the oracle of `kernels/fused_moe.py`."""
    num_tokens, hidden = x.shape
    local = w13.shape[0]
    inter = w13.shape[1] // 2
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    ids = topk_ids.long() - first_expert
    for e in torch.unique(ids[(ids >= 0) & (ids < local)]).tolist():
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        h = torch.nn.functional.linear(x[token].float(), w13[e].float())
        act = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype)
        y = torch.nn.functional.linear(act.float(), w2[e].float())
        out.index_add_(0, token, y * topk_weights[token, slot].float()[:, None])
    return out.to(out_dtype or x.dtype)


# --- FP8 weights and activations (W8A8): kernels/fp8_act_quant.py, fp8_gemv.py, fp8_gemm.py -----------
# Weights: float8_e4m3fn [N, K] with float32 scales [ceil(N / block_n), ceil(K / block_k)] (one scale per
# block_n x block_k block; block_n = 1 and block_k >= K: one per output channel). Activations: quantized per
# token and group of `group` columns (group = K: per token) with power-of-two scales, so dividing by a scale
# and multiplying by it are exact and every implementation writes the same bytes.

FP8_E4M3_MAX = 448.0
FP8_ACT_HEADROOM = 256.0  # an activation group's largest magnitude lands in (128, 256] (a power-of-two scale)
FP8_MIN_AMAX = 2.0**-100  # all-zero groups get a finite scale


def fp8_act_scale_reference(amax: torch.Tensor) -> torch.Tensor:
    """The power-of-two scale of a group whose largest magnitude is `amax` (float32): 2^ceil(log2 amax) / 256."""
    amax = amax.float().clamp_min(FP8_MIN_AMAX)
    mantissa, exponent = torch.frexp(amax)
    power = torch.where(mantissa == 0.5, amax, torch.ldexp(torch.ones_like(amax), exponent))
    return power / FP8_ACT_HEADROOM


def fp8_act_quant_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, K / group]); x ~= q * scale per group."""
    m, k = x.shape
    if k % group:
        raise ValueError(f"fp8 activation quantization: K={k} is not a multiple of the group {group}")
    xf = x.float().reshape(m, k // group, group)
    scale = fp8_act_scale_reference(xf.abs().amax(dim=-1))
    q = (xf / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(m, k), scale


def fp8_expand_scale_reference(scale: torch.Tensor, rows: int, cols: int, block_n: int, block_k: int
                               ) -> torch.Tensor:
    """Block scales [ceil(rows / block_n), ceil(cols / block_k)] -> one per element [rows, cols]."""
    return scale.float().repeat_interleave(block_n, 0)[:rows].repeat_interleave(block_k, 1)[:, :cols]


def fp8_dequantize_weight_reference(weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int
                                    ) -> torch.Tensor:
    """float8_e4m3fn weight [N, K] and its block scales -> float32 [N, K]."""
    n, k = weight.shape
    if block_n == 1 and scale.shape == (n, 1):  # per output channel: a broadcast
        return weight.float() * scale.float()
    return weight.float() * fp8_expand_scale_reference(scale, n, k, block_n, block_k)


def fp8_quantize_weight_reference(weight: torch.Tensor, block_n: int, block_k: int
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A 16/32-bit weight [N, K] -> (float8_e4m3fn [N, K], float32 scales [ceil(N / block_n), ceil(K / block_k)]),
    scale = the block's largest magnitude / 448 (the recipe of block-scaled FP8 checkpoints; block_n = 1 and
    block_k >= K: per output channel)."""
    n, k = weight.shape
    bn, bk = min(block_n, n), min(block_k, k)
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.float()
    amax = padded.view(nb, bn, kb, bk).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    full = fp8_expand_scale_reference(scale, n, k, bn, bk)
    q = (weight.float() / full).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_linear_reference(
    x: torch.Tensor,  # [M, K] (gated: [M, 2K] = gate | up, the input is silu(gate) * up)
    weight: torch.Tensor,  # float8_e4m3fn [N, K]
    scale: torch.Tensor,  # float32 [ceil(N / block_n), ceil(K / block_k)]
    block_n: int,
    block_k: int,
    group: int,  # activation columns per scale (K: per token)
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,  # None: x.dtype
    gated: bool = False,
    dequantized: torch.Tensor | None = None,  # the weight as float32, if the caller keeps it
) -> torch.Tensor:
    """The W8A8 matmul: x quantized per (token, group), times the dequantized weight, summed in float32,
    bias added, rounded once to `out_dtype`. The oracle of the FP8 kernels and the CPU path."""
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = (torch.nn.functional.silu(gate.float()) * up.float()).to(x.dtype)
    q, a_scale = fp8_act_quant_reference(x, group)
    a = q.float() * a_scale.repeat_interleave(group, 1)
    if dequantized is None:
        dequantized = fp8_dequantize_weight_reference(weight, scale, block_n, block_k)
    y = a @ dequantized.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


# --- int8 KV cache (`kv_cache_dtype=int8`): K and V Hadamard-rotated per head, int8 per (token, KV head) ----------
# Each stored row of a KV head is head_dim int8 values followed by the row's float32 scale as 4 bytes, so a cache
# is [num_blocks, block_size, Hkv, head_dim + 4] int8 and scales travel with their blocks (copies, prefix reuse).
# K and V are rotated by the orthonormal Hadamard matrix H first (q . k = (qH) . (kH); o = (P (vH)) H), which
# spreads a head's outlier dims over all dims before the per-row scale is taken.

KV_INT8_SCALE_BYTES = 4
KV_INT8_MAX = 127.0


def hadamard_reference(n: int, device: torch.device | None = None) -> torch.Tensor:
    """The n x n orthonormal Sylvester-Hadamard matrix (n a power of two), float32; symmetric, its own inverse."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"kv_cache_dtype=int8 needs a power-of-two head_dim, got {n}")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / n**0.5


def quantize_kv_int8_reference(x: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D] -> stored rows [T, Hkv, D + 4] int8: (x H) / scale rounded, then the float32 scale's bytes,
    scale = max |x H| of the row / 127."""
    d = x.shape[-1]
    rotated = x.float() @ hadamard_reference(d, x.device)
    scale = (rotated.abs().amax(dim=-1, keepdim=True) / KV_INT8_MAX).clamp_min(1e-30)
    q = (rotated / scale).round().clamp(-KV_INT8_MAX, KV_INT8_MAX).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_kv_int8_reference(rows: torch.Tensor) -> torch.Tensor:
    """Stored rows [..., D + 4] int8 -> float32 [..., D], still rotated (x H)."""
    d = rows.shape[-1] - KV_INT8_SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return rows[..., :d].float() * scale


def store_kv_int8_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor) -> None:
    """`store_kv_reference` for an int8 cache ([N, bs, Hkv, D + 4]): rows quantized and written at their slots."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = quantize_kv_int8_reference(key[keep])
    v_cache[blocks, offsets] = quantize_kv_int8_reference(value[keep])


def paged_attention_int8_reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                                   scale: float, window: int = 0) -> torch.Tensor:
    """`paged_attention_reference` over an int8 cache: the blocks the tables name dequantized (rotated), q
    rotated alike, attention in float32 (over each query's last `window` positions when > 0), the output
    rotated back; returns query.dtype."""
    d = k_cache.shape[-1] - KV_INT8_SCALE_BYTES
    block_size = k_cache.shape[1]
    needed = (seq_lens.long() + block_size - 1) // block_size
    cols = torch.arange(block_tables.shape[1], device=block_tables.device)
    used = torch.unique(block_tables.long()[cols[None, :] < needed[:, None]])
    local = torch.zeros(k_cache.shape[0], dtype=torch.int32, device=k_cache.device)
    local[used] = torch.arange(used.numel(), dtype=torch.int32, device=k_cache.device)
    tables = torch.where(cols[None, :] < needed[:, None], local[block_tables.long().clamp_min(0)], 0)
    k = dequantize_kv_int8_reference(k_cache[used])
    v = dequantize_kv_int8_reference(v_cache[used])
    h = hadamard_reference(d, query.device)
    out = paged_attention_reference(query.float() @ h, k, v, cu_seqlens_q, seq_lens, tables.to(torch.int32), scale,
                                    window=window)
    return (out @ h).to(query.dtype)
