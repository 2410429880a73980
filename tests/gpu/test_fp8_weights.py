"""FP8 weights (W8A8) on CUDA: the kernels at real Qwen3-8B shapes against their references, the dispatch's
paths, and the engine with quantization=fp8 (CUDA graphs give the eager tokens; an FP8 checkpoint loads)."""
import pytest
import torch

from spmd_engine.kernels.fp8_act_quant import fp8_act_quant
from spmd_engine.kernels.fp8_gemm import fp8_gemm
from spmd_engine.kernels.fp8_gemv import fp8_gemv
from spmd_engine.kernels.fp8_matmul import fp8_linear, scaled_mm_rowwise_works
from spmd_engine.kernels.reference import (fp8_act_quant_reference, fp8_linear_reference,
                                           fp8_quantize_weight_reference)
from tests.gpu.engine_setup import GPU, PROMPTS, greedy_tokens, make_llm, tiny_bf16_checkpoint
from tests.helpers.fp8_checkpoints import write_fp8_checkpoint

pytestmark = GPU

# (N, K): Qwen3-8B qkv, o_proj, gate_up, down
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


def operands(n, k, rows, block, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
    qw, scale = fp8_quantize_weight_reference(w, *block)
    return x, qw, scale


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("rows", [1, 7, 4096])
def test_act_quant_writes_the_reference_bytes_on_the_gpu(rows):
    x = torch.randn(rows, 4096, device="cuda").to(torch.bfloat16) * 3
    for group in (128, 4096):
        q, s = fp8_act_quant(x, group)
        q_ref, s_ref = fp8_act_quant_reference(x, group)
        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("block,group", [((128, 128), 128), ((1, 0), 128), ((1, 0), 0)],
                         ids=["block128", "channel-group128", "channel-token"])
def test_gemv_and_gemm_match_the_reference(n, k, block, group):
    block_k = block[1] or k
    group = group or k
    for rows in (1, 5, 16, 300):
        x, qw, scale = operands(n, k, rows, (block[0], block_k))
        per_row = scale.repeat_interleave(block[0], 0)[:n].contiguous()
        ref = fp8_linear_reference(x, qw, scale, block[0], block_k, group, out_dtype=torch.float32)
        qa, sa = fp8_act_quant(x, group)
        if rows <= 16:
            out = fp8_gemv(qa, sa, group, qw, per_row, 1, block_k, None, torch.float32)
        else:
            out = fp8_gemm(qa, sa, group, qw, per_row, 1, block_k, None, torch.float32)
        assert rel(out, ref) < 1e-5, rows
        dispatched = fp8_linear(x, qw, per_row, 1, block_k, group)
        assert dispatched.dtype == torch.bfloat16 and rel(dispatched, ref) < 1e-2


def test_gemv_rows_do_not_depend_on_m():
    x, qw, scale = operands(4096, 4096, 16, (1, 4096))
    full = fp8_linear(x, qw, scale, 1, 4096, 128)
    for m in (1, 2, 3, 4, 8, 15):
        assert torch.equal(fp8_linear(x[:m], qw, scale, 1, 4096, 128), full[:m]), m


def test_scaled_mm_path_runs_on_hopper():
    if torch.cuda.get_device_capability() >= (9, 0):
        assert scaled_mm_rowwise_works(torch.cuda.current_device())


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    src = tiny_bf16_checkpoint(tmp_path_factory.mktemp("bf16") / "ckpt")
    return src, write_fp8_checkpoint(src, tmp_path_factory.mktemp("fp8") / "ckpt")


@pytest.mark.parametrize("which", ["online", "checkpoint"])
def test_engine_graphs_give_the_eager_tokens(tiny_fp8, which):
    path = tiny_fp8[0] if which == "online" else tiny_fp8[1]
    keys = {"quantization": "fp8"} if which == "online" else {}
    graphed = make_llm(path, **keys)
    tokens = greedy_tokens(graphed, PROMPTS)
    eager = make_llm(path, enforce_eager=True, **keys)
    assert greedy_tokens(eager, PROMPTS) == tokens
    assert graphed.model.fp8_scheme is not None


@pytest.mark.parametrize("gated", [False, True])
def test_fused_gemv_gives_the_bits_of_act_quant_then_gemv_on_the_gpu(gated):
    from spmd_engine.kernels.fp8_gemv import fp8_gemv_fused

    x, qw, scale = operands(4096, 4096, 16, (1, 4096))
    if gated:
        x = torch.cat([x, x.flip(1)], dim=1)
    for m in (1, 3, 16):
        fused = fp8_gemv_fused(x[:m], 128, qw, scale, 1, 4096, None, torch.bfloat16, gated=gated)
        qa, sa = fp8_act_quant(x[:m], 128, gated=gated)
        assert torch.equal(fused, fp8_gemv(qa, sa, 128, qw, scale, 1, 4096, None, torch.bfloat16)), m
