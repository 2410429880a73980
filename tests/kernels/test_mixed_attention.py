"""The per-step attention plan (kernels/mixed_attention.py) against the two public kernels, bit for bit.

A mixed batch (decode rows first, then prompt chunks) through the plan's one launch must give exactly
the bytes of `paged_decode_attention` on the decode rows plus `paged_prefill_attention` on the rest
(the path the engine took before), for every layer that reuses the plan. Under TRITON_INTERPRET on
CPU (tiny shapes); on CUDA the gpu_case entries run real shapes.
"""
import dataclasses

import pytest
import torch

from spmd_engine.kernels import mixed_attention
from spmd_engine.kernels.decode_attention import DecodeConfig, default_decode_config, paged_decode_attention
from spmd_engine.kernels.mixed_attention import plan_paged_attention
from spmd_engine.kernels.prefill_attention import default_prefill_config, paged_prefill_attention
from tests.kernels.paged_batch import DEVICE, gpu_case, make_paged_batch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # triton interpreter noise

# many resident programs per SM: small decode batches get several splits (and the merge) on CPU too
SPLITTING = DecodeConfig(block_n=16, num_warps=1, num_stages=1, programs_per_sm=64, min_tokens_per_split=64)


def splitting_config(head_dim: int) -> DecodeConfig:
    """A config that splits the short 'splits' cases: on CUDA the device's tile (so the one launch still
    fuses with the prefill kernel), with short splits and many programs wanted, as SPLITTING on CPU."""
    if DEVICE.type == "cpu":
        return SPLITTING
    return dataclasses.replace(default_decode_config(head_dim, DEVICE), programs_per_sm=64, min_tokens_per_split=64)


def apart_from_prefill(config: DecodeConfig | None, head_dim: int, fp8: bool) -> DecodeConfig:
    """`config` (or the device's) with num_warps other than the prefill tile's: the plan then launches the
    decode and prefill kernels back to back (the engine's path where the tiles differ, e.g. an fp8 cache's
    one-warp decode tile on the GPU)."""
    config = config or default_decode_config(head_dim, DEVICE, fp8)
    prefill_warps = default_prefill_config(head_dim, DEVICE).num_warps
    if config.num_warps != prefill_warps:
        return config
    return dataclasses.replace(config, num_warps=2 * prefill_warps)


def two_kernel_path(batch, num_decode: int, decode_config=None) -> torch.Tensor:
    """The engine's path before the plan: decode kernel on the decode slice, prefill kernel on the rest."""
    out = torch.full_like(batch.query, float("nan"))
    scales = {"k_scale": batch.k_scale, "v_scale": batch.v_scale}
    n = num_decode
    if n:
        paged_decode_attention(batch.query[:n], batch.k_cache, batch.v_cache, batch.seq_lens[:n],
                               batch.block_tables[:n], batch.scale, out[:n], config=decode_config, **scales)
    if n < batch.seq_lens.shape[0]:
        paged_prefill_attention(batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q[n:].clone(),
                                batch.seq_lens[n:].clone(), batch.block_tables[n:], batch.scale,
                                batch.max_query_len, out, **scales)
    return out


def planned(batch, num_decode: int, decode_config=None):
    out = torch.full_like(batch.query, float("nan"))
    plan = plan_paged_attention(batch.query, batch.k_cache, batch.v_cache, out, batch.cu_seqlens_q, batch.seq_lens,
                                batch.block_tables, num_decode, batch.max_query_len, k_scale=batch.k_scale,
                                v_scale=batch.v_scale, decode_config=decode_config)
    return plan, out


# (decode seq_lens, prompt (query_len, seq_len)s, block_size, Hq, Hkv, head_dim, dtype, fp8 cache, splitting)
CASES = [
    pytest.param([5, 17, 33], [(7, 7), (3, 20)], 16, 4, 2, 16, torch.float32, False, False, id="bs16-gqa2-fp32"),
    pytest.param([300, 1], [(18, 30)], 8, 4, 1, 16, torch.float16, False, True, id="bs8-gqa4-fp16-splits"),
    pytest.param([70, 3, 129, 9], [(1, 1), (17, 17), (2, 65)], 64, 4, 4, 16, torch.float32, False, True,
                 id="bs64-mha-fp32-splits-1tok-chunk"),
    pytest.param([9, 40], [(17, 50), (5, 5)], 16, 4, 1, 16, torch.float16, True, False, id="bs16-gqa4-fp8"),
    pytest.param([200, 3], [(20, 21)], 32, 4, 2, 16, torch.float32, True, True, id="bs32-gqa2-fp8-fp32-splits"),
    gpu_case([512 + 17 * i for i in range(250)], [(390, 900), (390, 390)], 16, 16, 8, 128, torch.bfloat16, False,
             False),
    gpu_case([300, 4000, 17], [(1024, 1024), (77, 2000)], 16, 16, 8, 128, torch.bfloat16, False, False),
    gpu_case([1024 + i for i in range(200)], [(128, 128)] * 6, 256, 16, 8, 128, torch.bfloat16, True, False),
    gpu_case([100, 2000], [(300, 700)], 16, 32, 4, 64, torch.float16, False, False),
    gpu_case([3000, 100, 5], [(200, 400)], 16, 8, 8, 256, torch.bfloat16, False, False),
]


@pytest.mark.parametrize("decode_lens,prompts,block_size,hq,hkv,head_dim,dtype,fp8,splitting", CASES)
@pytest.mark.parametrize("fuse", [True, False], ids=["one-launch", "two-launches"])
def test_plan_is_bitwise_the_two_kernel_path(decode_lens, prompts, block_size, hq, hkv, head_dim, dtype, fp8,
                                             splitting, fuse):
    query_lens = [1] * len(decode_lens) + [q for q, _ in prompts]
    seq_lens = decode_lens + [s for _, s in prompts]
    batch = make_paged_batch(query_lens, seq_lens, block_size, hq, hkv, head_dim, dtype, seed=len(seq_lens),
                             kv_fp8=fp8)
    n = len(decode_lens)
    config = splitting_config(head_dim) if splitting else None
    if not fuse:  # a decode tile that cannot share the prefill tile's launch
        config = apart_from_prefill(config, head_dim, fp8)
    expected = two_kernel_path(batch, n, config)
    plan, out = planned(batch, n, config)
    if splitting:
        assert plan.partial_shape[2] > 1, "the case must exercise the split partials and their merge"
    # one launch only where the two tiles share num_warps (on an H200, not an fp8 cache's one-warp decode tile)
    decode_warps = (config or default_decode_config(head_dim, DEVICE, fp8)).num_warps
    shares_warps = decode_warps == default_prefill_config(head_dim, DEVICE).num_warps
    assert (plan.mixed is not None) == (fuse and shares_warps)
    plan.launch(batch.query, batch.k_cache, batch.v_cache, out, batch.scale, batch.k_scale, batch.v_scale)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    # a second layer: other query and caches of the same geometry, through the same plan
    other = make_paged_batch(query_lens, seq_lens, block_size, hq, hkv, head_dim, dtype, seed=99, kv_fp8=fp8)
    other.cu_seqlens_q, other.seq_lens, other.block_tables = batch.cu_seqlens_q, batch.seq_lens, batch.block_tables
    expected = two_kernel_path(other, n, config)
    out2 = torch.full_like(out, float("nan"))
    plan.launch(other.query, other.k_cache, other.v_cache, out2, other.scale, other.k_scale, other.v_scale)
    assert torch.equal(out2.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("num_decode", [0, 4])
def test_prefill_only_and_decode_only_steps_match_the_public_kernels(num_decode):
    query_lens = [1] * 4 if num_decode else [6, 1, 9]
    seq_lens = [20, 3, 40, 17] if num_decode else [6, 8, 30]
    batch = make_paged_batch(query_lens, seq_lens, 16, 4, 2, 16, torch.float32, seed=5)
    plan, out = planned(batch, num_decode, SPLITTING)
    assert plan.mixed is None and (plan.decode is None) == (num_decode == 0)
    plan.launch(batch.query, batch.k_cache, batch.v_cache, out, batch.scale)
    assert torch.equal(out, two_kernel_path(batch, num_decode, SPLITTING))


class LaunchRecorder:
    """Stands in for the jitted kernels' `kernel[grid]`: records (kernel, grid, tensor args), launches nothing."""

    def __init__(self, monkeypatch) -> None:
        self.launches: list[tuple[str, tuple, list[torch.Tensor]]] = []
        for name in ("_mixed_paged_attention_kernel", "_decode_split_kernel", "_paged_prefill_kernel"):
            kernel = getattr(mixed_attention, name)
            monkeypatch.setattr(type(kernel), "__getitem__", lambda k, grid: self._launcher(k, grid))

    def _launcher(self, kernel, grid):
        def launch(*args, **kwargs):
            self.launches.append((kernel.fn.__name__, tuple(grid), [a for a in args if isinstance(a, torch.Tensor)]))
        return launch


@pytest.mark.parametrize("num_decode", range(1, 6))
def test_mixed_batch_is_one_launch_with_16_byte_aligned_pointers(monkeypatch, num_decode):
    """Whatever the number of decode rows, the mixed launch gets the whole (unsliced) metadata tensors:
    Triton specialises pointers on 16-byte alignment, so a slice at a data-dependent offset would
    compile a new kernel variant mid-job."""
    query_lens = [1] * num_decode + [7, 3]
    batch = make_paged_batch(query_lens, [9] * num_decode + [7, 12], 16, 4, 2, 16, torch.float32, seed=1)
    plan, out = planned(batch, num_decode)
    recorder = LaunchRecorder(monkeypatch)
    plan.launch(batch.query, batch.k_cache, batch.v_cache, out, batch.scale)
    assert [name for name, _, _ in recorder.launches] == ["_mixed_paged_attention_kernel"]
    _, grid, tensors = recorder.launches[0]
    assert grid == (1 * 4 * 2 + num_decode * 2 * 1,)  # prefill (tiles x Hq x prompts) + decode (seqs x Hkv x 1)
    assert all(t.data_ptr() % 16 == 0 for t in tensors)


def test_plan_refuses_bad_inputs_with_one_clear_line():
    batch = make_paged_batch([1, 4], [5, 4], 16, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="num_decode must be in"):
        planned(batch, 3)
    with pytest.raises(ValueError, match="contiguous head_dim"):
        plan_paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.query.transpose(0, 1),
                             batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, 1, 4)


@pytest.mark.parametrize("share", [True, False])
def test_split_partials_are_shared_by_layers_only_when_asked(share):
    """Shared: one pair made by the first launch serves every layer. Not shared (decode steps, which a
    CUDA-graph capture may run after warm-ups over the same metadata): each launch allocates its own."""
    batch = make_paged_batch([1, 1], [300, 40], 8, 4, 2, 16, torch.float32, seed=2)
    out = torch.empty_like(batch.query)
    plan = plan_paged_attention(batch.query, batch.k_cache, batch.v_cache, out, batch.cu_seqlens_q, batch.seq_lens,
                                batch.block_tables, 2, 1, decode_config=SPLITTING, share_partials=share)
    assert plan.partial_shape[2] > 1 and plan.partials is None
    plan.launch(batch.query, batch.k_cache, batch.v_cache, out, batch.scale)
    first = plan.partials
    plan.launch(batch.query, batch.k_cache, batch.v_cache, out, batch.scale)
    assert (first is not None and plan.partials is first) if share else plan.partials is None
    assert torch.equal(out, two_kernel_path(batch, 2, SPLITTING))
