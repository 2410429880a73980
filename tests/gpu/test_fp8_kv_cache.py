"""kv_cache_dtype=fp8 on CUDA: the Triton store/prefill/decode path against the torch reference at the
Qwen3-0.6B attention shape in bf16, and the engine with fp8 KV (CUDA graphs, memory sizing)."""
from __future__ import annotations

import pytest
import torch

from spmd_engine.kernels.kv_quant import FP8_DTYPE
from spmd_engine.models.attention_metadata import AttentionMetadata
from spmd_engine.models.layers.attention import Attention
from spmd_engine.executor.kv_cache import fp8_scales_from_absmax
from tests.gpu.engine_setup import GPU, PROMPTS, greedy_tokens, make_llm, tiny_bf16_checkpoint
from tests.kernels.paged_batch import rel_error

pytestmark = GPU
HQ, HKV, D, BLOCK = 16, 8, 128, 16  # Qwen3-0.6B attention, one rank


def _metadata(chunks: list[tuple[int, int]], tables: torch.Tensor, is_decode: bool) -> AttentionMetadata:
    """Sequence b computes positions [start, end) of chunks[b]; its blocks are tables[b]."""
    slots = [int(tables[b, p // BLOCK]) * BLOCK + p % BLOCK for b, (s, e) in enumerate(chunks) for p in range(s, e)]
    lens = torch.tensor([e - s for s, e in chunks], dtype=torch.int32)
    cu = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    seq_lens = torch.tensor([e for _, e in chunks], dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cuda"), cu_seqlens_q=cu.cuda(),
        seq_lens=seq_lens.cuda(), block_tables=tables.cuda(), max_query_len=int(lens.max()),
        max_seq_len=int(seq_lens.max()), block_size=BLOCK, is_decode=is_decode)


def test_triton_fp8_layer_matches_the_reference_at_qwen3_shape():
    """Chunked prefill (cached prefixes), then decode steps: both backends store and read fp8 with the
    same power-of-two scales; the caches are byte-identical and the outputs agree to bf16 rounding."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = [1500, 37, 700, 2100]
    chunk, decode_steps = 512, 8
    blocks_per_seq = -(-(max(lengths) + decode_steps) // BLOCK)
    tables = torch.randperm(blocks_per_seq * len(lengths)).view(len(lengths), blocks_per_seq).to(torch.int32)
    # keys with a few large channels (like rotary outliers), values O(1); per-head magnitudes differ
    key_gain = torch.ones(HKV, D, device="cuda")
    key_gain[:, :4] = 12.0
    key_gain *= torch.linspace(0.5, 4.0, HKV, device="cuda")[:, None]
    scales = fp8_scales_from_absmax(torch.stack([(3 * key_gain).amax(1),
                                                 torch.full((HKV,), 3.0, device="cuda")])).cuda()
    layers = {}
    for backend in ("triton", "torch"):
        layer = Attention(HQ, HKV, D, D**-0.5, backend)
        layer.k_cache = torch.zeros(blocks_per_seq * len(lengths), BLOCK, HKV, D, dtype=FP8_DTYPE, device="cuda")
        layer.v_cache = torch.zeros_like(layer.k_cache)
        layer.k_scale, layer.v_scale = scales[0].contiguous(), scales[1].contiguous()
        layers[backend] = layer

    def step(chunks: list[tuple[int, int]], is_decode: bool) -> None:
        n = sum(e - s for s, e in chunks)
        q = torch.randn(n, HQ * D, generator=gen, device="cuda").bfloat16()
        k = (torch.randn(n, HKV, D, generator=gen, device="cuda") * key_gain).bfloat16().view(n, -1)
        v = torch.randn(n, HKV * D, generator=gen, device="cuda").bfloat16()
        attn = _metadata(chunks, tables, is_decode)
        out = {name: layer(q, k, v, attn) for name, layer in layers.items()}
        assert rel_error(out["triton"], out["torch"]) < 1e-2
        assert torch.equal(layers["triton"].k_cache.view(torch.uint8), layers["torch"].k_cache.view(torch.uint8))
        assert torch.equal(layers["triton"].v_cache.view(torch.uint8), layers["torch"].v_cache.view(torch.uint8))

    done = [0] * len(lengths)
    while any(d < n for d, n in zip(done, lengths)):
        chunks = [(d, min(d + chunk, n)) for d, n in zip(done, lengths)]
        step(chunks, False)
        done = [e for _, e in chunks]
    for _ in range(decode_steps):
        step([(d, d + 1) for d in done], True)
        done = [d + 1 for d in done]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_bf16_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def test_fp8_engine_graphs_match_eager(checkpoint):
    tokens = []
    for eager in (True, False):
        llm = make_llm(checkpoint, kv_cache_dtype="fp8", enforce_eager=eager, attention_backend="triton")
        try:
            assert (llm.runner.graphs is None) == eager and llm.runner.spec.dtype == FP8_DTYPE
            tokens.append(greedy_tokens(llm, PROMPTS))
        finally:
            llm.close()
    assert tokens[0] == tokens[1]  # the same kernels, replayed


def test_fp8_pool_holds_twice_the_blocks_of_bf16(checkpoint):
    pools = {}
    for kv in ("auto", "fp8"):
        llm = make_llm(checkpoint, kv_cache_dtype=kv, num_kv_blocks=None, gpu_memory_utilization=0.3)
        try:
            pools[kv] = (llm.runner.num_blocks, llm.runner.spec.bytes_per_block, llm.kv_capacity.as_dict()["tokens"])
        finally:
            llm.close()
    (auto_blocks, auto_bytes, auto_tokens), (fp8_blocks, fp8_bytes, fp8_tokens) = pools["auto"], pools["fp8"]
    assert 2 * fp8_bytes == auto_bytes
    assert fp8_blocks > 1.9 * auto_blocks and fp8_tokens > 1.9 * auto_tokens


def test_fp8_engine_first_tokens_match_the_torch_reference(checkpoint):
    """Triton (graphs) and torch attention over the same fp8 cache: the first greedy tokens agree."""
    results = []
    for backend in ("triton", "torch"):
        llm = make_llm(checkpoint, kv_cache_dtype="fp8", attention_backend=backend)
        try:
            results.append(greedy_tokens(llm, PROMPTS))
        finally:
            llm.close()
    assert [t[:4] for t in results[0]] == [t[:4] for t in results[1]]


def test_nan_bytes_past_an_odd_end_change_nothing():
    """An fp8 V cache stores pairs of positions and the kernels read whole pairs: an odd sequence end's
    partner slot (stale bytes; e4m3 NaN among them) is read with p = 0, and made finite first, since
    0 * NaN is NaN. Decode and prefill outputs with NaN bytes in every slot past each end are the bits of
    the same caches with zeros there. (GPU only: TRITON_INTERPRET's min propagates NaN.)"""
    from spmd_engine.kernels.decode_attention import paged_decode_attention
    from spmd_engine.kernels.prefill_attention import paged_prefill_attention
    from tests.kernels.paged_batch import make_paged_batch

    lens = [1, 7, 129, 300, 1001, 16, 33]  # odd ends, and even ones
    for query_lens in ([1] * len(lens), [1, 7, 20, 64, 100, 16, 5]):
        batch = make_paged_batch(query_lens, lens, BLOCK, HQ, HKV, D, torch.bfloat16, seed=5, kv_fp8=True)
        outs = []
        for fill in (0x00, 0x7F):
            k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
            for b, n in enumerate(lens):
                for pos in range(n, -(-n // BLOCK) * BLOCK):  # the rest of the sequence's last block
                    block = int(batch.block_tables[b, pos // BLOCK])
                    k_cache.view(torch.uint8)[block, pos % BLOCK] = fill
                    v_cache.view(torch.uint8).view(-1, BLOCK // 2, HKV, D, 2)[block, pos % BLOCK // 2, :, :,
                                                                             pos % 2] = fill
            scales = dict(k_scale=batch.k_scale, v_scale=batch.v_scale)
            if max(query_lens) == 1:
                out = paged_decode_attention(batch.query, k_cache, v_cache, batch.seq_lens, batch.block_tables,
                                             batch.scale, **scales)
            else:
                out = paged_prefill_attention(batch.query, k_cache, v_cache, batch.cu_seqlens_q, batch.seq_lens,
                                              batch.block_tables, batch.scale, batch.max_query_len, **scales)
            outs.append(out)
        assert not outs[1].isnan().any()
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
