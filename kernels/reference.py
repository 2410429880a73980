"""Plain-torch oracles for the KV-cache write and paged attention.

They are the CPU path of the engine and the ground truth the Triton kernels are tested against.
KV cache layout (every backend): [num_blocks, block_size, num_kv_heads, head_dim]. A
float8_e4m3fn cache comes with per-KV-head scales (`kernels/kv_quant.py`): written quantized,
upcast to float32 and multiplied by its scale on read.
"""
from __future__ import annotations

import torch

from kernels.kv_quant import check_kv_scales, quantize_fp8_reference


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
        v_cache[blocks, offsets] = quantize_fp8_reference(value[keep], v_scale)
        return
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
    k_scale: torch.Tensor | None = None,  # [Hkv] float32, only with a float8_e4m3fn cache
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context (GQA aware).

    Accumulates in float32 and returns query.dtype; an fp8 cache is dequantized on read. The mask is aligned lower-right: query i of a
    sequence with q_len new tokens and seq_len keys sees keys 0 .. seq_len - q_len + i.
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
        v = gather_kv_reference(v_cache, block_tables[b], seq_len).float()
        if fp8:
            k = k * k_scale[None, :, None]
            v = v * v_scale[None, :, None]
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
