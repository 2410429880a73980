"""The per-step attention plan on CUDA at Qwen3-0.6B attention shape: one launch per layer for a mixed
batch, bit for bit the decode-kernel + prefill-kernel path, and no new kernel variant as the batch
composition changes (issue #15)."""
import copy
import dataclasses

import pytest
import torch

from spmd_engine.kernels import mixed_attention
from spmd_engine.kernels.decode_attention import default_decode_config, paged_decode_attention
from spmd_engine.kernels.mixed_attention import plan_paged_attention
from spmd_engine.kernels.prefill_attention import default_prefill_config, paged_prefill_attention
from tests.gpu.engine_setup import GPU
from tests.kernels.paged_batch import make_paged_batch

pytestmark = GPU

HQ, HKV, D = 16, 8, 128


def two_kernel_path(batch, n: int, decode_config=None) -> torch.Tensor:
    """The engine's path before the plan (decode kernel on the first n rows, prefill kernel on the rest)."""
    out = torch.full_like(batch.query, float("nan"))
    scales = {"k_scale": batch.k_scale, "v_scale": batch.v_scale}
    if n:
        paged_decode_attention(batch.query[:n], batch.k_cache, batch.v_cache, batch.seq_lens[:n],
                               batch.block_tables[:n], batch.scale, out[:n], config=decode_config, **scales)
    paged_prefill_attention(batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q[n:].clone(),
                            batch.seq_lens[n:].clone(), batch.block_tables[n:], batch.scale, batch.max_query_len,
                            out, **scales)
    return out


def mixed_batch(num_decode, context, prompts, block_size, dtype=torch.bfloat16, fp8=False, seed=0, spread=400):
    """num_decode decode rows of context .. context + spread keys, then the (query_len, seq_len) prompts."""
    query_lens = [1] * num_decode + [q for q, _ in prompts]
    seq_lens = [context + (37 * i) % spread for i in range(num_decode)] + [s for _, s in prompts]
    return make_paged_batch(query_lens, seq_lens, block_size, HQ, HKV, D, dtype, seed=seed, kv_fp8=fp8)


@pytest.mark.parametrize("num_decode,context,prompts,block_size,fp8", [
    (250, 600, [(390, 390), (390, 1500)], 16, False),  # the steady-state mixed step: one split, one launch
    (200, 600, [(1024, 1024)], 16, True),
    (250, 600, [(128, 128)] * 6, 256, False),
    (8, 2048, [(512, 512)], 16, False),  # few decodes: several splits (the last arrival merges them)
    (3, 4000, [(77, 2000), (1, 300)], 16, True),
    (1, 100, [(1000, 1000)], 32, False),
])
def test_one_plan_over_several_layers_is_bitwise_the_two_kernel_path(num_decode, context, prompts, block_size, fp8):
    batch = mixed_batch(num_decode, context, prompts, block_size, fp8=fp8)
    # the 16-bit cache's decode tile shares num_warps with the prefill tile: one launch for an fp8 cache too
    # (whose own one-warp tile takes two launches: test_fp8_cache_default_tiles_take_two_launches_bitwise)
    config = default_decode_config(D, torch.device("cuda"))
    plan = None
    for layer in range(3):  # other caches and queries of the same geometry: the plan of the first layer
        current = copy.copy(batch)
        if layer:
            current.query, current.k_cache, current.v_cache = (
                x.view(torch.uint8).roll(layer, 0).view(x.dtype) for x in (batch.query, batch.k_cache, batch.v_cache))
        out = torch.full_like(current.query, float("nan"))
        if plan is None:
            plan = plan_paged_attention(current.query, current.k_cache, current.v_cache, out, current.cu_seqlens_q,
                                        current.seq_lens, current.block_tables, num_decode, current.max_query_len,
                                        k_scale=current.k_scale, v_scale=current.v_scale, decode_config=config)
            assert plan.mixed is not None
        plan.launch(current.query, current.k_cache, current.v_cache, out, current.scale, current.k_scale,
                    current.v_scale)
        expected = two_kernel_path(current, num_decode, config)
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), layer


@pytest.mark.parametrize("num_decode,context,prompts", [(200, 600, [(1024, 1024)]), (3, 4000, [(77, 2000), (1, 300)])])
def test_fp8_cache_default_tiles_take_two_launches_bitwise(num_decode, context, prompts):
    """An fp8 cache's default decode tile (one warp) cannot share the prefill tile's launch: the plan runs the
    runtime-split-count decode kernel, then the prefill kernel, bit for bit the public kernels."""
    batch = mixed_batch(num_decode, context, prompts, 16, fp8=True)
    out = torch.full_like(batch.query, float("nan"))
    plan = plan_paged_attention(batch.query, batch.k_cache, batch.v_cache, out, batch.cu_seqlens_q, batch.seq_lens,
                                batch.block_tables, num_decode, batch.max_query_len, k_scale=batch.k_scale,
                                v_scale=batch.v_scale)
    assert plan.mixed is None and plan.decode is not None and plan.prefill is not None
    plan.launch(batch.query, batch.k_cache, batch.v_cache, out, batch.scale, batch.k_scale, batch.v_scale)
    assert torch.equal(out.view(torch.int16), two_kernel_path(batch, num_decode).view(torch.int16))


@pytest.mark.parametrize("fuse", [True, False], ids=["one-launch", "two-launches"])
def test_batch_composition_compiles_no_new_variant(fuse):
    """Decode counts and prompt lengths of any alignment reuse the one compiled mixed kernel (pointers
    and data-dependent ints, the decode split count among them, are never specialised on the composition:
    a variant per split count compiled in the first mixed steps of a job, 0.4 s each); in two launches (a
    decode tile whose num_warps differ from the prefill tile's), the one compiled runtime-count decode kernel."""
    kernel = mixed_attention._mixed_paged_attention_kernel if fuse else mixed_attention._decode_any_splits_kernel
    config = default_decode_config(D, torch.device("cuda"))
    if not fuse:
        config = dataclasses.replace(config, num_warps=2 * default_prefill_config(D, torch.device("cuda")).num_warps)
    sizes, splits = [], set()
    for num_decode in (*range(100, 117), 1, 2, 3, 5, 8, 13, 21, 34, 55):  # 1 to 64 splits at Hkv=8 on an H200
        # decode contexts < 2000: the block-table width (an int stride Triton specialises) stays the same
        batch = mixed_batch(num_decode, 100, [(num_decode + 3, 2000), (17, 17)], 16, seed=num_decode, spread=200)
        out = torch.empty_like(batch.query)
        plan = plan_paged_attention(batch.query, batch.k_cache, batch.v_cache, out, batch.cu_seqlens_q,
                                    batch.seq_lens, batch.block_tables, num_decode, batch.max_query_len,
                                    decode_config=config)
        assert (plan.mixed is not None) == fuse
        plan.launch(batch.query, batch.k_cache, batch.v_cache, out, batch.scale)
        assert torch.equal(out, two_kernel_path(batch, num_decode, config))
        sizes.append(len(kernel.device_caches[torch.cuda.current_device()][0]))
        splits.add(plan.partial_shape[2])
    assert len(splits) > 3, splits
    assert len(set(sizes)) == 1 and sizes[0] >= 1, sizes  # one compiled variant, and it is the one launched


def test_decode_graph_captured_after_warmups_over_the_same_metadata_owns_its_partials():
    """The decode graphs warm up and capture over one AttentionMetadata: the captured split partials
    must come from the graph's pool, not from a plan the warm-up made (freed with the metadata, then
    handed to other tensors that every replay would overwrite)."""
    from spmd_engine.models.attention_metadata import AttentionMetadata
    from spmd_engine.models.layers.attention import Attention

    batch = mixed_batch(8, 2048, [], 16)  # 8 decode rows of ~2k keys: several splits and the merge
    layer = Attention(HQ, HKV, D, batch.scale, "triton")
    layer.k_cache, layer.v_cache = batch.k_cache, batch.v_cache
    attn = AttentionMetadata(torch.full((8,), -1, device="cuda"), batch.cu_seqlens_q, batch.seq_lens,
                             batch.block_tables, 1, int(batch.seq_lens.max()), 16, is_decode=True)
    q, out = batch.query.view(8, HQ * D), torch.empty(8, HQ * D, dtype=batch.query.dtype, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            layer.attend(q, None, None, attn, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.attend(q, None, None, attn, out=out)
    del attn
    torch.cuda.synchronize()
    others = [torch.full((8, HQ, 64, D), 7.0, device="cuda") for _ in range(64)]  # take any freed blocks
    graph.replay()
    torch.cuda.synchronize()
    assert all(bool((t == 7.0).all()) for t in others)
    assert torch.equal(out.view(8, HQ, D), two_kernel_path(batch, 8)[:8])


def test_engine_start_compiles_every_attention_kernel_its_steps_launch(tmp_path):
    """A new engine launches the prefill and one-launch mixed kernels once at start-up, so a job's
    prefill and mixed steps (a small token budget chunks the prompts) compile nothing: the mixed
    kernel's compile (~2 s) was inside the first mixed step of every job on a fresh machine."""
    from spmd_engine.kernels.prefill_attention import _paged_prefill_kernel
    from tests.gpu.engine_setup import PROMPTS, greedy_tokens, make_llm, tiny_bf16_checkpoint

    def variants():
        device = torch.cuda.current_device()
        return [len(k.device_caches[device][0]) for k in (mixed_attention._mixed_paged_attention_kernel,
                                                          _paged_prefill_kernel)]

    checkpoint = tiny_bf16_checkpoint(tmp_path / "ckpt")
    llm = make_llm(checkpoint, attention_backend="triton", max_num_batched_tokens=64)
    try:
        at_start = variants()
        greedy_tokens(llm, PROMPTS)
        assert llm.runner.piecewise.num_replays > 2  # the job's own prefill and mixed steps ran
        assert variants() == at_start
    finally:
        llm.close()


@pytest.mark.parametrize("num_decode,context,prompts,block_size,fp8", [
    (250, 600, [(390, 390), (390, 1500)], 16, False),
    (200, 600, [(1024, 1024)], 16, True),
    (8, 2048, [(512, 512)], 16, False),
    (3, 4000, [(77, 2000), (1, 300)], 16, True),
])
def test_decode_rows_on_the_cuda_kernel_and_the_prompt_chunks_planned_alone(num_decode, context, prompts, block_size,
                                                                           fp8):
    """`decode_rows_elsewhere`, as the CUDA decode attention backend runs a mixed step
    (models/layers/attention_backends/cuda_decode.py): the plan launches the prefill kernel over the prompt
    chunks only (their rows bit for bit the two-kernel path's, the decode rows untouched) and the cache's CUDA
    decode kernel takes the decode rows (close to the Triton decode kernel's: another summation order)."""
    from spmd_engine.kernels import decode_attention_cuda, decode_attention_fp8_cuda

    batch = mixed_batch(num_decode, context, prompts, block_size, fp8=fp8)
    module = decode_attention_fp8_cuda if fp8 else decode_attention_cuda
    n = num_decode
    if not module.supports(batch.query[:n], batch.k_cache, batch.v_cache):
        pytest.skip("the CUDA decode kernel does not take this machine or shape")
    scales = {"k_scale": batch.k_scale, "v_scale": batch.v_scale}
    expected = two_kernel_path(batch, n)
    out = torch.full_like(batch.query, float("nan"))
    plan = plan_paged_attention(batch.query, batch.k_cache, batch.v_cache, out, batch.cu_seqlens_q, batch.seq_lens,
                                batch.block_tables, n, batch.max_query_len, decode_rows_elsewhere=True, **scales)
    assert plan.mixed is None and plan.decode is None and plan.prefill is not None
    plan.launch(batch.query, batch.k_cache, batch.v_cache, out, batch.scale, batch.k_scale, batch.v_scale)
    assert torch.isnan(out[:n]).all()  # the decode rows are the caller's
    assert torch.equal(out[n:], expected[n:])
    attend = module.paged_decode_attention_fp8 if fp8 else module.paged_decode_attention_cuda
    attend(batch.query[:n], batch.k_cache, batch.v_cache, batch.seq_lens[:n], batch.block_tables[:n], batch.scale,
           out[:n], **(scales if fp8 else {}))
    torch.testing.assert_close(out[:n].float(), expected[:n].float(), rtol=2e-2, atol=2e-2)
