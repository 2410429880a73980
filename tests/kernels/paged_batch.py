"""Random paged-KV batches shared by the kernel tests (shuffled block tables, non-zero caches)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def gpu_case(*values) -> object:
    """A parametrize entry that only runs on CUDA (real shapes, bf16)."""
    return pytest.param(*values, marks=[pytest.mark.gpu, ON_GPU])


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten or bad softmax)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@dataclass
class PagedBatch:
    """Inputs of one paged-attention call; every sequence's blocks are scattered in the cache."""

    query: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [N, bs, Hkv, D]
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, M] int32, tail filled with other valid block ids
    max_query_len: int
    scale: float
    k_scale: torch.Tensor | None = None  # [Hkv] float32 with a float8_e4m3fn cache
    v_scale: torch.Tensor | None = None

    def reference(self) -> torch.Tensor:
        from spmd_engine.kernels.reference import paged_attention_reference

        return paged_attention_reference(
            self.query, self.k_cache, self.v_cache, self.cu_seqlens_q, self.seq_lens, self.block_tables,
            self.scale, self.k_scale, self.v_scale,
        )


def fp8_kv(values: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """values [N, bs, Hkv, D] -> (float8_e4m3fn cache, [Hkv] scales): each head gets its own scale
    (non-powers of two too) and its values span that scale's whole fp8 range, subnormals included."""
    from spmd_engine.kernels.kv_quant import FP8_DTYPE, FP8_MAX

    heads = values.shape[2]
    scale = torch.exp2(torch.randint(-6, 4, (heads,), generator=gen).float()) * torch.tensor(
        [1.0, 0.75, 1.3, 1.0] * heads)[:heads]
    # a wide spread of magnitudes per element: 2**-12 .. 2**8 times the scale
    spread = torch.exp2(torch.empty(values.shape).uniform_(-12, 8, generator=gen))
    stored = (values.float().sign() * spread).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return stored, scale


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    kv_fp8: bool = False,
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    max_blocks = max(blocks_per_seq) + 1  # an unused tail column, like the engine's padded tables
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    k_scale = v_scale = None
    if kv_fp8:
        k_cache, k_scale = fp8_kv(k_cache, gen)
        v_cache, v_scale = fp8_kv(v_cache, gen)
        # keep softmax logits O(1): dequantized keys at most ~4 (fp8 values up to 2**8)
        k_scale = k_scale / (64 * k_scale.max())
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = order[used : used + n]
        used += n
    cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(query_lens).cumsum(0)
    query = torch.randn((int(cu[-1]), num_q_heads, head_dim), generator=gen).to(dtype)
    return PagedBatch(
        query=query.to(DEVICE),
        k_cache=k_cache.to(DEVICE),
        v_cache=v_cache.to(DEVICE),
        cu_seqlens_q=cu.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(torch.int32).to(DEVICE),
        max_query_len=max(query_lens),
        scale=head_dim**-0.5,
        k_scale=None if k_scale is None else k_scale.to(DEVICE),
        v_scale=None if v_scale is None else v_scale.to(DEVICE),
    )
