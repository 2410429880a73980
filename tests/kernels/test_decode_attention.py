import pytest
import torch

from spmd_engine.kernels import decode_attention as decode_module
from spmd_engine.kernels.decode_attention import (
    MAX_SPLITS,
    MIN_COUNTERS,
    MIN_TOKENS_PER_SPLIT,
    decode_num_splits,
    default_decode_config,
    merge_counters,
    paged_decode_attention,
)
from spmd_engine.kernels.attention_support import supports_shape as supports
from spmd_engine.kernels.reference import paged_attention_reference
from tests.helpers.split_oracles import second_launch_reductions
from tests.kernels.paged_batch import DEVICE, ON_GPU, gpu_case, make_paged_batch, rel_error

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # triton interpreter noise

# (seq_lens, block_size, Hq, Hkv, head_dim, dtype, num_splits (None = by shape), max rel error)
CASES = [
    pytest.param([1, 16, 17, 40], 16, 4, 4, 32, torch.float32, None, 1e-5, id="bs16-gqa1-fp32-single"),
    # seq 3 leaves most of its 4 splits empty: neutral partials must not disturb the merge
    pytest.param([70, 3, 129], 64, 4, 2, 16, torch.float16, 4, 2e-3, id="bs64-gqa2-fp16-split4"),
    # an empty (padded) sequence gets zeros, like the reference
    pytest.param([300, 0, 5], 256, 8, 1, 16, torch.float32, 3, 1e-5, id="bs256-gqa8-fp32-split3"),
    # block smaller than the key tile: per-row block-id gather
    pytest.param([9, 33], 8, 8, 2, 16, torch.float16, 2, 2e-3, id="bs8-gqa4-fp16-split2"),
    gpu_case([512 + 97 * i for i in range(64)], 16, 16, 8, 128, torch.bfloat16, None, 1e-2),
    gpu_case([4096 - 31 * i for i in range(96)], 256, 16, 8, 128, torch.bfloat16, None, 1e-2),
    gpu_case([1, 4096, 17, 2048], 16, 32, 4, 128, torch.bfloat16, None, 1e-2),
    gpu_case([1, 4096, 17, 2048], 32, 64, 8, 64, torch.float16, 7, 2e-3),
    gpu_case([3000, 100], 16, 8, 8, 256, torch.bfloat16, None, 1e-2),
]


def _reference(batch):
    return paged_attention_reference(
        batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens,
        batch.block_tables, batch.scale,
    )


@pytest.mark.parametrize("seq_lens,block_size,hq,hkv,head_dim,dtype,num_splits,tol", CASES)
def test_matches_reference(seq_lens, block_size, hq, hkv, head_dim, dtype, num_splits, tol):
    batch = make_paged_batch([1] * len(seq_lens), seq_lens, block_size, hq, hkv, head_dim, dtype)
    out = torch.full_like(batch.query, float("nan"))
    result = paged_decode_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables,
        batch.scale, out=out, num_splits=num_splits,
    )
    assert result is out
    assert rel_error(out, _reference(batch)) < tol


def test_cuda_tile_config_on_small_batch():
    """The H200 key tile (several 16-position blocks per tile) with and without splits."""
    batch = make_paged_batch([1, 1, 1], [300, 1, 90], 16, 4, 2, 16, torch.float32, seed=3)
    config = default_decode_config(128, torch.device("cuda"))
    for num_splits in (1, 3):
        out = paged_decode_attention(
            batch.query, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables,
            batch.scale, num_splits=num_splits, config=config,
        )
        assert rel_error(out, _reference(batch)) < 1e-5


def test_num_splits_depends_only_on_shapes():
    # a full GPU of (sequence, KV head) programs needs no split
    assert decode_num_splits(256, 8, 128, 16, target_programs=528) == 1
    # batch 1 at 2k context: split up to the length limit (MIN_TOKENS_PER_SPLIT each), within bounds
    assert decode_num_splits(1, 8, 128, 16, target_programs=528) == 2048 // MIN_TOKENS_PER_SPLIT
    assert decode_num_splits(1, 8, 128, 16, target_programs=528, min_tokens_per_split=128) == 16
    assert decode_num_splits(1, 1, 10_000, 256, target_programs=10_000) == MAX_SPLITS
    assert decode_num_splits(4, 2, 1, 16, target_programs=528) == 1


def test_a_small_second_wave_costs_a_split():
    """With `small_second_wave`, the count that fills 396 resident programs (132 SMs x 3) drops by one where
    it overshoots them by at most that fraction (8 rows x 8 KV heads: 7 splits = 448 programs -> 6), and
    stays where the overshoot is larger (16 rows: 4 splits = 512) or absent."""
    splits = lambda rows, slack: decode_num_splits(rows, 8, 256, 16, target_programs=396,  # noqa: E731
                                                   small_second_wave=slack)
    assert [splits(r, 0.0) for r in (4, 8, 12, 16)] == [13, 7, 5, 4]
    assert [splits(r, 0.15) for r in (1, 4, 8, 12, 16)] == [16, 12, 6, 5, 4]
    assert splits(33, 0.15) == 2  # 264 pairs: 2 splits (528 programs) overshoot by a third
    assert decode_num_splits(33, 12, 256, 16, target_programs=396, small_second_wave=0.15) == 1  # 396: one wave


def test_supports_and_clear_errors():
    assert supports(16, 128) and supports(128, 64) and supports(8, 32)
    assert not supports(48, 128) and not supports(16, 96)
    batch = make_paged_batch([1], [5], 16, 2, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(
            batch.query, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables,
            batch.scale, num_splits=MAX_SPLITS + 1,
        )
    with pytest.raises(ValueError, match="block_size"):
        cache = torch.zeros(2, 12, 2, 16, device=DEVICE)
        paged_decode_attention(batch.query, cache, cache, batch.seq_lens, batch.block_tables, 1.0)


@pytest.mark.gpu
@ON_GPU
def test_cuda_graph_replay_follows_new_seq_lens():
    """Captured once, replayed with other lengths: no host sync, no length baked into the graph."""
    batch = make_paged_batch([1] * 64, [2048] * 64, 16, 16, 8, 128, torch.bfloat16, seed=4)
    seq_lens = batch.seq_lens.clone()
    out = torch.empty_like(batch.query)

    def step():
        paged_decode_attention(
            batch.query, batch.k_cache, batch.v_cache, seq_lens, batch.block_tables, batch.scale, out=out
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lengths in ([2048] * 64, [1 + 31 * i for i in range(64)], [0] * 32 + [700] * 32):
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        batch.seq_lens = seq_lens
        assert rel_error(out, _reference(batch)) < 1e-2


def test_cuda_fp8_tile_config_on_small_batch():
    """The GPU's fp8 decode tile (one warp, 64 keys), with and without splits, against the reference."""
    batch = make_paged_batch([1, 1, 1], [150, 7, 64], 16, 4, 2, 128, torch.float16, seed=5, kv_fp8=True)
    config = default_decode_config(128, torch.device("cuda"), kv_fp8=True)
    assert config.num_warps == 1 and config.block_n == 64
    for num_splits in (1, 2):
        out = paged_decode_attention(
            batch.query, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, batch.scale,
            num_splits=num_splits, config=config, k_scale=batch.k_scale, v_scale=batch.v_scale,
        )
        assert rel_error(out, batch.reference()) < 2e-3


# (seq_lens, block_size, Hq, Hkv, head_dim, dtype, num_splits, max rel error) with a float8_e4m3fn cache
FP8_CASES = [
    pytest.param([1, 16, 17, 40], 16, 4, 4, 32, torch.float32, None, 1e-5, id="bs16-gqa1-fp32-single"),
    pytest.param([70, 3, 129], 64, 4, 2, 16, torch.float16, 4, 2e-3, id="bs64-gqa2-fp16-split4"),
    pytest.param([9, 33], 8, 8, 2, 16, torch.float32, 2, 1e-5, id="bs8-gqa4-fp32-split2"),
    # a 128-wide head under a 16-bit model: the chunked fp8 tiles (`_attend_fp8_in_chunks`)
    pytest.param([40, 7, 33], 16, 4, 2, 128, torch.float16, None, 2e-3, id="bs16-gqa2-fp16-d128"),
    pytest.param([40, 7, 33], 16, 4, 2, 128, torch.float16, 3, 2e-3, id="bs16-gqa2-fp16-d128-split3"),
    gpu_case([512 + 97 * i for i in range(64)], 16, 16, 8, 128, torch.bfloat16, None, 1e-2),
    gpu_case([1, 4096, 17, 2048], 16, 32, 4, 128, torch.bfloat16, None, 1e-2),
    gpu_case([3000, 100], 16, 8, 8, 256, torch.bfloat16, None, 1e-2),
]


@pytest.mark.parametrize("seq_lens,block_size,hq,hkv,head_dim,dtype,num_splits,tol", FP8_CASES)
def test_fp8_cache_matches_reference(seq_lens, block_size, hq, hkv, head_dim, dtype, num_splits, tol):
    """fp8 K/V upcast on load with per-KV-head scales, against the reference's dequantize-then-attend."""
    batch = make_paged_batch([1] * len(seq_lens), seq_lens, block_size, hq, hkv, head_dim, dtype, kv_fp8=True)
    out = paged_decode_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, batch.scale,
        num_splits=num_splits, k_scale=batch.k_scale, v_scale=batch.v_scale,
    )
    ref = batch.reference()
    assert rel_error(out, ref) < tol
    # the scales matter: ignoring them (scale 1) is far off
    ones = torch.ones_like(batch.k_scale)
    unscaled = paged_decode_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, batch.scale,
        num_splits=num_splits, k_scale=ones, v_scale=ones,
    )
    assert rel_error(unscaled, ref) > 0.1


def test_fp8_cache_needs_its_scales():
    batch = make_paged_batch([1], [5], 16, 2, 2, 16, torch.float32, kv_fp8=True)
    with pytest.raises(ValueError, match="needs k_scale"):
        paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables,
                               batch.scale)
    with pytest.raises(ValueError, match=r"v_scale must be a contiguous \[2\] float32"):
        paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables,
                               batch.scale, k_scale=batch.k_scale, v_scale=batch.v_scale.double())


# (seq_lens, block_size, Hq, Hkv, head_dim, dtype, num_splits, fp8 cache): the fused merge against the second
# launch (no bf16: bf16 under the interpreter is far off the reference on main too; the GPU tests cover it)
MERGE_CASES = [
    # seq 3 leaves most of its splits empty (neutral partials)
    pytest.param([70, 3, 129], 64, 4, 2, 16, torch.float16, 4, False, id="bs64-gqa2-fp16-split4"),
    # an empty sequence: every split neutral, output zeros
    pytest.param([300, 0, 5], 256, 8, 1, 16, torch.float32, 3, False, id="bs256-gqa8-fp32-split3"),
    pytest.param([9, 33], 8, 8, 2, 16, torch.float16, 2, False, id="bs8-gqa4-fp16-split2"),
    # GQA 3: padding rows of the 16-row head tile must not be merged or stored; odd split count
    pytest.param([300, 1, 260, 77, 16], 16, 6, 2, 32, torch.float16, 7, False, id="bs16-gqa3-fp16-split7"),
    pytest.param([200], 16, 2, 1, 16, torch.float32, MAX_SPLITS, False, id="b1-fp32-max-splits"),
    pytest.param([70, 3, 129], 64, 4, 2, 16, torch.float16, 5, True, id="fp8-bs64-gqa2-fp16-split5"),
    pytest.param([9, 33, 1], 8, 8, 2, 16, torch.float32, 2, True, id="fp8-bs8-gqa4-fp32-split2"),
]


def _decode(batch, out, **kwargs):
    out.fill_(float("nan"))  # an unwritten row shows up as NaN
    scales = {"k_scale": batch.k_scale, "v_scale": batch.v_scale}
    return paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables,
                                  batch.scale, out=out, **scales, **kwargs)


@pytest.fixture
def nan_partials(monkeypatch):
    """Fresh NaN partial buffers each call: a merge that read a partial before its split wrote it (or a
    previous call's, left in reused memory) shows up as NaN."""
    split_partials = decode_module._split_partials

    def poisoned(query, out, num_splits):
        partial_out, partial_lse = split_partials(query, out, num_splits)
        if num_splits > 1:
            partial_out.fill_(float("nan"))
            partial_lse.fill_(float("nan"))
        return partial_out, partial_lse

    monkeypatch.setattr(decode_module, "_split_partials", poisoned)


def _second_launch(batch, **kwargs):
    """The split kernel's partials merged by the oracle's second launch (tests/helpers/split_oracles.py)."""
    with second_launch_reductions() as second:
        out = _decode(batch, torch.empty_like(batch.query), **kwargs).clone()
    assert second.names == ["_decode_split_kernel"], "the split partials must be merged by the oracle"
    return out


@pytest.mark.parametrize("seq_lens,block_size,hq,hkv,head_dim,dtype,num_splits,kv_fp8", MERGE_CASES)
def test_fused_merge_equals_the_second_launch(seq_lens, block_size, hq, hkv, head_dim, dtype, num_splits, kv_fp8,
                                               nan_partials):
    """The last split program of each (sequence, KV head) merges the partials in the order of the oracle's
    merge kernel (same bits), leaves the counters at zero, and does so again on the next call."""
    batch = make_paged_batch([1] * len(seq_lens), seq_lens, block_size, hq, hkv, head_dim, dtype, kv_fp8=kv_fp8)
    two = _second_launch(batch, num_splits=num_splits)
    assert rel_error(two, batch.reference()) < (1e-5 if dtype == torch.float32 else 1e-2)
    out = torch.empty_like(batch.query)
    for _ in range(2):  # a counter left non-zero would skip the next call's merge (NaN rows)
        assert torch.equal(_decode(batch, out, num_splits=num_splits), two)
        assert not merge_counters(batch.query.device).any()
    # new lengths through the same tensors (as a graph replay sees them): still the second launch's bits
    batch.seq_lens.copy_(torch.tensor([max(0, n - 37 * i) for i, n in enumerate(seq_lens)], dtype=torch.int32))
    two = _second_launch(batch, num_splits=num_splits)
    assert torch.equal(_decode(batch, out, num_splits=num_splits), two)
    assert not merge_counters(batch.query.device).any()


def test_default_merges_without_a_second_launch(monkeypatch, nan_partials):
    batch = make_paged_batch([1, 1], [90, 40], 16, 4, 2, 16, torch.float32, seed=5)
    two = _second_launch(batch, num_splits=3)
    launches = []
    kernel_type = type(decode_module._decode_split_kernel)
    getitem = kernel_type.__getitem__
    monkeypatch.setattr(kernel_type, "__getitem__", lambda k, grid: launches.append(k.fn.__name__) or getitem(k, grid))
    assert torch.equal(_decode(batch, torch.empty_like(batch.query), num_splits=3), two)
    assert launches == ["_decode_split_kernel"]
    # one split: the split kernel writes the output itself, no counters involved
    one = _decode(batch, torch.empty_like(batch.query), num_splits=1)
    assert rel_error(one, batch.reference()) < 1e-5


def test_merge_counters_are_allocated_once_and_grow_outside_capture():
    device = DEVICE
    first = merge_counters(device)
    assert first.numel() >= MIN_COUNTERS and first.dtype == torch.int32 and not first.any()
    assert merge_counters(device, 10) is first  # the same buffer every call: its pointer is graph-safe
    grown = merge_counters(device, first.numel() + 1)
    assert grown.numel() == first.numel() + 1 and not grown.any()
    assert merge_counters(device) is grown and first in decode_module._OUTGROWN  # earlier graphs keep theirs
