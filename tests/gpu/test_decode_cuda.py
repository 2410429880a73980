"""The CUDA decode kernel for bf16/fp16 caches (kernels/decode_attention_cuda.py) against the torch
reference and the Triton kernel: GQA groups, block sizes, lengths around tile and block edges, split
counts, NaN bytes past every end and in unowned blocks, a float16 model, and CUDA-graph replay; and the
prologue by which it prepares q and the new K/V itself, against qk_norm_rope_store before it."""
from __future__ import annotations

import math

import pytest
import torch

from spmd_engine.kernels.decode_attention import paged_decode_attention
from spmd_engine.kernels.reference import paged_attention_reference
from tests.gpu.engine_setup import GPU

pytestmark = GPU
D = 128
LENGTHS = [1, 2, 3, 63, 64, 65, 127, 128, 129, 777, 1500, 2049]


def _cuda_decode():
    from spmd_engine.kernels import cuda_rtc, decode_attention_cuda

    try:
        cuda_rtc._nvrtc()
    except cuda_rtc.CudaRtcUnavailable as err:
        pytest.skip(str(err))
    return decode_attention_cuda


def _inputs(lengths, hq, hkv, block_size, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [math.ceil(n / block_size) for n in lengths]
    total = sum(blocks) + 2
    k = (torch.randn(total, block_size, hkv, D, device="cuda", generator=gen) * 2).to(dtype)
    v = (torch.randn(total, block_size, hkv, D, device="cuda", generator=gen) * 2).to(dtype)
    order = torch.randperm(total, device="cuda", generator=gen).to(torch.int32)
    tables = torch.zeros(len(lengths), max(blocks) + 1, dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(lengths):
        tables[b, :blocks[b]] = order[used:used + blocks[b]]
        used += blocks[b]
        for pos in range(n, blocks[b] * block_size):  # NaN past the end inside the last block
            blk, slot = int(tables[b, pos // block_size]), pos % block_size
            k[blk, slot] = float("nan")
            v[blk, slot] = float("nan")
    for blk in order[used:].tolist():  # and in the blocks nobody owns
        k[blk] = float("nan")
        v[blk] = float("nan")
    query = torch.randn(len(lengths), hq, D, device="cuda", dtype=dtype, generator=gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return query, k, v, seq_lens, tables


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("hq,hkv", [(16, 8), (32, 8), (8, 8), (14, 2)])
@pytest.mark.parametrize("block_size", [2, 16, 32, 128])
def test_cuda_decode_matches_the_reference(hq, hkv, block_size):
    cuda_decode = _cuda_decode()
    query, k, v, seq_lens, tables = _inputs(LENGTHS, hq, hkv, block_size)
    assert cuda_decode.supports(query, k, v)
    cu = torch.arange(len(LENGTHS) + 1, dtype=torch.int32, device="cuda")
    ref = paged_attention_reference(query, k, v, cu, seq_lens, tables, 0.088)
    triton_err = _rel(paged_decode_attention(query, k, v, seq_lens, tables, 0.088), ref)
    for splits in (None, 1, 3, 8):
        out = cuda_decode.paged_decode_attention_cuda(query, k, v, seq_lens, tables, 0.088, num_splits=splits)
        assert torch.isfinite(out).all(), splits
        # bf16 dots and P with float32 sums, as the Triton kernel: the same order of error
        assert _rel(out, ref) < max(2 * triton_err, 4e-3), (splits, _rel(out, ref), triton_err)


def test_cuda_decode_float16_model_and_graph_replay():
    cuda_decode = _cuda_decode()
    query, k, v, seq_lens, tables = _inputs([5, 300, 1025, 64], 16, 8, 16, dtype=torch.float16)
    cu = torch.arange(5, dtype=torch.int32, device="cuda")
    ref = paged_attention_reference(query, k, v, cu, seq_lens, tables, 0.088)
    eager = cuda_decode.paged_decode_attention_cuda(query, k, v, seq_lens, tables, 0.088)
    assert _rel(eager, ref) < 2e-3
    out = torch.empty_like(query)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda_decode.paged_decode_attention_cuda(query, k, v, seq_lens, tables, 0.088, out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_cuda_decode_refuses_what_it_does_not_take():
    cuda_decode = _cuda_decode()
    query, k, v, *_ = _inputs([10], 16, 8, 16)
    assert not cuda_decode.supports(query[..., :64], k[..., :64], v[..., :64])  # head_dim 64
    assert not cuda_decode.supports(query.float(), k, v)  # a float32 model
    assert not cuda_decode.supports(query.half(), k, v)  # the cache in another dtype
    q16 = torch.randn(1, 32, D, device="cuda", dtype=torch.bfloat16)
    assert not cuda_decode.supports(q16, k[:, :, :2].contiguous(), v[:, :, :2].contiguous())  # 16 query heads a KV head


def test_cuda_decode_merges_alike_in_the_kernel_and_by_a_second_launch(monkeypatch):
    """The last split to finish merges or (no arrival counters: a null pointer) the tests' Triton merge kernel
    (tests/helpers/split_oracles.py) does after the launch: the same result within rounding, and the arrival
    counters are back at zero after every launch (graph replays reuse them)."""
    from spmd_engine.kernels import decode_attention as da
    from tests.helpers.split_oracles import merge_splits

    cuda_decode = _cuda_decode()
    query, k, v, seq_lens, tables = _inputs(LENGTHS, 16, 8, 16)
    fused = cuda_decode.paged_decode_attention_cuda(query, k, v, seq_lens, tables, 0.088, num_splits=5)
    torch.cuda.synchronize()
    assert int(da.merge_counters(query.device).abs().sum()) == 0
    partials = []
    split_partials = da._split_partials
    monkeypatch.setattr(da, "_split_partials", lambda *args: partials.append(split_partials(*args)) or partials[-1])
    monkeypatch.setattr(da, "merge_counters", lambda device, count=0: 0)  # null: the splits leave their partials
    second = cuda_decode.paged_decode_attention_cuda(query, k, v, seq_lens, tables, 0.088, num_splits=5)
    merge_splits(*partials[-1], second)
    assert _rel(fused, second) < 1e-2 and (fused.float() - second.float()).abs().max().item() < 2e-2


def test_cuda_decode_under_pdl_waits_for_its_producer():
    """Launched with PDL (kernels/pdl.py) right after the kernel that writes its query, inside a captured
    graph as the engine's small decode graphs run it: the same output as without PDL."""
    from spmd_engine.kernels.pdl import pdl_launches, pdl_supported

    cuda_decode = _cuda_decode()
    if not pdl_supported(torch.device("cuda")):
        pytest.skip("PDL needs sm_90+ and a Triton with grid-dependency control")
    query, k, v, seq_lens, tables = _inputs([700, 3, 1500, 64], 16, 8, 16)
    source = torch.randn_like(query)
    expected = cuda_decode.paged_decode_attention_cuda(source * 3, k, v, seq_lens, tables, 0.088)
    out = torch.empty_like(query)
    with pdl_launches(True):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.mul(source, 3, out=query)  # the producer: the kernel must not read q before it is done
            cuda_decode.paged_decode_attention_cuda(query, k, v, seq_lens, tables, 0.088, out)
    query.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_cuda_decode_under_pdl_streams_old_keys_early_and_waits_for_the_new_row():
    """Under PDL the kernel copies tiles of older keys before `griddepcontrol.wait` (they overlap its
    predecessor); q and each sequence's last key/value row, which the predecessor writes, are read only
    after it. The producer here lets its successor launch at once, spins, then writes q and the last rows
    over NaN: any early read of them shows in the output. Lengths put the last row in the first tile, in a
    later one, and in every split."""
    import triton
    import triton.language as tl

    from spmd_engine.kernels.pdl import pdl_launch, pdl_launches, pdl_prologue, pdl_supported

    @triton.jit
    def _late_producer(q_src, q_dst, k_src, v_src, k_cache, v_cache, row_offsets, spin_seed,
                       Q_ELEMS: tl.constexpr, KV_ELEMS: tl.constexpr, SPIN: tl.constexpr, USE_PDL: tl.constexpr):
        pdl_prologue(USE_PDL)  # waits for its own predecessor, then lets the attention kernel launch
        seq = tl.program_id(0)
        acc = tl.load(spin_seed)
        for _ in range(SPIN):
            acc = acc * 0.9999999 + 1e-7
        late = acc > -1.0  # unknown to the compiler: the stores stay after the spin
        q_cols = tl.arange(0, Q_ELEMS)
        tl.store(q_dst + seq * Q_ELEMS + q_cols, tl.load(q_src + seq * Q_ELEMS + q_cols), mask=late)
        kv_cols = tl.arange(0, KV_ELEMS)
        row = tl.load(row_offsets + seq)
        tl.store(k_cache + row + kv_cols, tl.load(k_src + seq * KV_ELEMS + kv_cols), mask=late)
        tl.store(v_cache + row + kv_cols, tl.load(v_src + seq * KV_ELEMS + kv_cols), mask=late)

    cuda_decode = _cuda_decode()
    device = torch.device("cuda")
    if not pdl_supported(device):
        pytest.skip("PDL needs sm_90+ and a Triton with grid-dependency control")
    lengths, hq, hkv, block_size = [1, 3, 64, 65, 700, 1500, 2049], 16, 8, 16
    query, k, v, seq_lens, tables = _inputs(lengths, hq, hkv, block_size)
    rows = torch.tensor([int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                         for b, n in enumerate(lengths)], device="cuda")
    k_last, v_last = k.view(-1, hkv * D)[rows].clone(), v.view(-1, hkv * D)[rows].clone()
    q_true = query.clone()
    spin_seed = torch.ones(1, device="cuda")

    def produce():
        _late_producer[(len(lengths),)](q_true, query, k_last, v_last, k, v, rows * (hkv * D), spin_seed,
                                        Q_ELEMS=hq * D, KV_ELEMS=hkv * D, SPIN=20000, **pdl_launch(device))

    with pdl_launches(True):
        produce()  # compiled outside the capture
    for splits in (None, 1, 4):
        expected = cuda_decode.paged_decode_attention_cuda(q_true, k, v, seq_lens, tables, 0.088, num_splits=splits)
        out = torch.empty_like(query)
        with pdl_launches(True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                produce()
                cuda_decode.paged_decode_attention_cuda(query, k, v, seq_lens, tables, 0.088, out, num_splits=splits)
        for _ in range(3):
            query.fill_(float("nan"))
            k.view(-1, hkv * D)[rows] = float("nan")
            v.view(-1, hkv * D)[rows] = float("nan")
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, expected), f"splits={splits}"


def _prologue_case(lengths, hq, hkv, block_size, norm, dtype=torch.bfloat16, seed=1, caches=None):
    """A decode step as the model hands it over: the qkv projection's rows (q/k/v views of one [B, (hq + 2 hkv) D]
    tensor), the rotary tables of each row's position, norm weights, and slots at each sequence's last position
    (which holds an older random row there: a path that skips the store, or attends that row, differs; the last
    row's slot -1 with a known finite row already in the cache). `caches`: the (k_cache, v_cache) of `lengths`
    with their `seq_lens` and `tables` (default: this file's bf16 `_inputs`; a caller's fp8 caches get no slot -1
    row)."""
    from spmd_engine.kernels.decode_attention_cuda import DecodePrologue

    if caches is None:
        k_cache, v_cache, seq_lens, tables = _inputs(lengths, hq, hkv, block_size, dtype, seed)[1:]
    else:
        k_cache, v_cache, seq_lens, tables = caches
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    qkv = (torch.randn(len(lengths), (hq + 2 * hkv) * D, device="cuda", generator=gen) * 2).to(dtype)
    q, k, v = qkv.split([hq * D, hkv * D, hkv * D], dim=1)
    positions = (seq_lens - 1).double()
    inv_freq = 1e6 ** (-torch.arange(0, D, 2, device="cuda", dtype=torch.float64) / D)
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    weights = [(1 + 0.2 * torch.randn(D, device="cuda", generator=gen)).to(dtype) for _ in range(2)] if norm \
        else [None, None]
    slots = torch.tensor([int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for b, n in enumerate(lengths)], device="cuda")
    if caches is None:
        last = int(slots[-1])
        k_cache.view(-1, hkv, D)[last] = 0.5
        v_cache.view(-1, hkv, D)[last] = -0.25
        slots[-1] = -1
    prologue = DecodePrologue(k.view(-1, hkv, D), v.view(-1, hkv, D), cos, sin, slots, *weights, eps=1e-6)
    return q.view(-1, hq, D), k_cache, v_cache, seq_lens, tables, prologue


def _two_launches(query, k_cache, v_cache, seq_lens, tables, prologue, splits):
    """qk_norm_rope_store, then the kernel on the rotated q: what the prologue replaces."""
    from spmd_engine.kernels.qk_norm_rope_store import qk_norm_rope_store

    p = prologue
    rotated = qk_norm_rope_store(query, p.k, p.v, p.cos, p.sin, k_cache, v_cache, p.slot_mapping, p.q_weight,
                                 p.k_weight, p.eps)
    return _cuda_decode().paged_decode_attention_cuda(rotated, k_cache, v_cache, seq_lens, tables, 0.088,
                                                      num_splits=splits)


@pytest.mark.parametrize("hq,hkv", [(16, 8), (14, 2), (8, 8)])
@pytest.mark.parametrize("block_size", [2, 16])
@pytest.mark.parametrize("norm", [True, False])
def test_cuda_decode_prepares_its_own_q_and_new_kv_as_the_store_kernel_does(hq, hkv, block_size, norm):
    """With a `DecodePrologue` the kernel norms and rotates q, and norms, rotates and stores the new K/V, itself:
    the cache as qk_norm_rope_store leaves it (V bit for bit; K within the last bit, the norm's sum running in
    another order) and the output of the two launches, for every split count; slot -1 stores nothing."""
    cuda_decode = _cuda_decode()
    lengths = LENGTHS + [40]
    query, k_cache, v_cache, seq_lens, tables, prologue = _prologue_case(lengths, hq, hkv, block_size, norm)
    for splits in (None, 1, 3, 8):
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        expected = _two_launches(query, k_ref, v_ref, seq_lens, tables, prologue, splits)
        k_got, v_got = k_cache.clone(), v_cache.clone()
        out = cuda_decode.paged_decode_attention_cuda(query, k_got, v_got, seq_lens, tables, 0.088,
                                                      num_splits=splits, prologue=prologue)
        assert torch.isfinite(out).all(), splits
        assert torch.equal(v_got.nan_to_num(7.0), v_ref.nan_to_num(7.0)), splits
        k_diff = (k_got.float() - k_ref.float()).nan_to_num(0.0).abs()
        assert torch.equal(k_got.isnan(), k_ref.isnan()), splits
        assert (k_diff <= k_ref.float().abs().nan_to_num(0.0) / 128).all(), (splits, k_diff.max().item())
        assert int((k_diff > 0).sum()) <= k_diff.numel() // 1000, splits  # a last-bit tie now and then at most
        assert _rel(out, expected) < 2e-3, (splits, _rel(out, expected))
        slot_last = int(tables[-1, (lengths[-1] - 1) // block_size]) * block_size + (lengths[-1] - 1) % block_size
        assert (k_got.view(-1, hkv, D)[slot_last] == 0.5).all() and (v_got.view(-1, hkv, D)[slot_last] == -0.25).all()


def test_cuda_decode_prologue_float16_and_refusals():
    from spmd_engine.kernels.decode_attention_cuda import DecodePrologue

    cuda_decode = _cuda_decode()
    query, k_cache, v_cache, seq_lens, tables, prologue = _prologue_case([5, 300, 1025, 64], 16, 8, 16, True,
                                                                         dtype=torch.float16)
    expected = _two_launches(query, k_cache.clone(), v_cache.clone(), seq_lens, tables, prologue, None)
    out = cuda_decode.paged_decode_attention_cuda(query, k_cache, v_cache, seq_lens, tables, 0.088, prologue=prologue)
    assert _rel(out, expected) < 2e-3
    p = prologue
    assert not DecodePrologue(p.k, p.v, p.cos[:, :32], p.sin[:, :32], p.slot_mapping).fits(query)  # partial rotary
    assert not DecodePrologue(p.k, p.v, p.cos, p.sin, p.slot_mapping.int()).fits(query)  # int32 slots
    assert not DecodePrologue(p.k, p.v, p.cos, p.sin, p.slot_mapping, p.q_weight, None).fits(query)
    with pytest.raises(ValueError, match="DecodePrologue.fits"):
        cuda_decode.paged_decode_attention_cuda(query, k_cache, v_cache, seq_lens, tables, 0.088,
                                                prologue=DecodePrologue(p.k, p.v, p.cos.float(), p.sin.float(),
                                                                        p.slot_mapping))


def test_cuda_decode_prologue_under_pdl_reads_the_projection_only_after_its_producer():
    """Under PDL, in a captured graph, after a producer that lets it launch at once and writes the qkv rows
    late: the prologue reads q/k/v only after `griddepcontrol.wait`, and attends the new K/V it made (written
    over its tile in shared memory), never the cache's row before its own store (NaN before every replay)."""
    import triton
    import triton.language as tl

    from spmd_engine.kernels.pdl import pdl_launch, pdl_launches, pdl_prologue, pdl_supported

    @triton.jit
    def _late_rows(src, dst, spin_seed, ELEMS: tl.constexpr, SPIN: tl.constexpr, USE_PDL: tl.constexpr):
        pdl_prologue(USE_PDL)
        row = tl.program_id(0)
        acc = tl.load(spin_seed)
        for _ in range(SPIN):
            acc = acc * 0.9999999 + 1e-7
        cols = tl.arange(0, ELEMS)
        tl.store(dst + row * ELEMS + cols, tl.load(src + row * ELEMS + cols), mask=acc > -1.0)

    cuda_decode = _cuda_decode()
    device = torch.device("cuda")
    if not pdl_supported(device):
        pytest.skip("PDL needs sm_90+ and a Triton with grid-dependency control")
    lengths, hq, hkv, block_size = [1, 3, 64, 65, 700, 1500, 2049, 9], 16, 8, 16
    query, k_cache, v_cache, seq_lens, tables, prologue = _prologue_case(lengths, hq, hkv, block_size, True)
    qkv = query.as_strided((len(lengths), (hq + 2 * hkv) * D), (query.stride(0), 1))
    qkv_true, spin_seed = qkv.clone(), torch.ones(1, device="cuda")
    slots = prologue.slot_mapping[prologue.slot_mapping >= 0]

    def produce():
        _late_rows[(len(lengths),)](qkv_true, qkv, spin_seed, ELEMS=(hq + 2 * hkv) * D, SPIN=20000,
                                    **pdl_launch(device))

    with pdl_launches(True):
        produce()  # compiled outside the capture
    for splits in (None, 1, 4):
        expected = cuda_decode.paged_decode_attention_cuda(query, k_cache, v_cache, seq_lens, tables, 0.088,
                                                           num_splits=splits, prologue=prologue)
        out = torch.empty_like(expected)
        with pdl_launches(True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                produce()
                cuda_decode.paged_decode_attention_cuda(query, k_cache, v_cache, seq_lens, tables, 0.088, out,
                                                        num_splits=splits, prologue=prologue)
        for _ in range(3):
            qkv.fill_(float("nan"))
            k_cache.view(-1, hkv, D)[slots] = float("nan")
            v_cache.view(-1, hkv, D)[slots] = float("nan")
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, expected), f"splits={splits}"
