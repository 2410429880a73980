"""The FP8 (W8A8) kernels against their plain-torch references, under TRITON_INTERPRET on CPU (tiny shapes):
activation quantization byte for byte, the GEMV and the block-scaled GEMM to float32 rounding."""
import pytest
import torch

from spmd_engine.kernels.fp8_act_quant import fp8_act_quant
from spmd_engine.kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm, k_step
from spmd_engine.kernels.fp8_gemv import fp8_gemv
from spmd_engine.kernels.fp8_matmul import fp8_linear
from spmd_engine.kernels.reference import (fp8_act_quant_reference, fp8_act_scale_reference,
                                           fp8_dequantize_weight_reference, fp8_linear_reference,
                                           fp8_quantize_weight_reference)
from tests.kernels.paged_batch import DEVICE

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # triton interpreter noise
SMALL_GEMM = Fp8GemmConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=1)


def bytes_of(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).cpu()


def activations(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, k)).to(dtype).to(DEVICE)


def test_scales_are_powers_of_two_with_the_group_max_in_128_to_256():
    amax = torch.tensor([1.0, 1.5, 2.0, 3e-5, 1e4, 0.0])
    scale = fp8_act_scale_reference(amax)
    assert torch.equal(torch.frexp(scale)[0], torch.full_like(scale, 0.5))  # powers of two
    ratio = amax[:5] / scale[:5]
    assert ((ratio > 128) & (ratio <= 256)).all() and scale[5] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [32, 128])
def test_act_quant_writes_the_reference_bytes(dtype, group):
    x = activations(5, 128, dtype)
    x[1] = 0.0  # an all-zero row
    x[2, :4] = torch.tensor([-0.0, 1e-9, -1e-9, 0.0]).to(dtype)  # zeros keep their sign; fp8 underflow
    q, s = fp8_act_quant(x, group)
    q_ref, s_ref = fp8_act_quant_reference(x.cpu(), group)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(bytes_of(q), bytes_of(q_ref))


def test_act_quant_rounds_ties_to_even_on_the_e4m3_grid():
    # a group max of 256 gives scale 1; 17 and 19 lie halfway between e4m3 neighbours (16, 18, 20)
    x = torch.tensor([[256.0, 17.0, 19.0, -17.0, 0.5 + 2**-5, 2**-10, 3 * 2**-10, 100.0]]).to(DEVICE)
    q, s = fp8_act_quant(x, 8)
    q_ref, _ = fp8_act_quant_reference(x.cpu(), 8)
    assert s.item() == 1.0
    assert torch.equal(bytes_of(q), bytes_of(q_ref))
    assert q.float().cpu()[0, 1:4].tolist() == [16.0, 20.0, -16.0]


def test_gated_act_quant_quantizes_silu_gate_times_up():
    x = activations(3, 128, torch.float16, seed=1)
    q, s = fp8_act_quant(x, 32, gated=True)
    gate, up = x.cpu().chunk(2, dim=-1)
    q_ref, s_ref = fp8_act_quant_reference((torch.nn.functional.silu(gate.float()) * up.float()).half(), 32)
    assert torch.equal(s.cpu(), s_ref)
    assert (q.float().cpu() - q_ref.float()).abs().max() <= 2 * q_ref.float().abs().max() / 2**4  # one e4m3 step


def weights(n: int, k: int, block: tuple[int, int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    q, scale = fp8_quantize_weight_reference(w, *block)
    return q.to(DEVICE), scale.to(DEVICE)


def per_row(scale: torch.Tensor, n: int, block_n: int) -> torch.Tensor:
    return scale.repeat_interleave(block_n, 0)[:n].contiguous()


# (block_n, block_k) of the weights; group of the activations: block-scaled like Qwen's checkpoints, per
# channel with 32-column or per-token activations; N = 40 leaves a partial last tile
CASES = {"block32": ((32, 32), 32), "channel-group": ((1, 0), 32), "channel-token": ((1, 0), 96)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("m", [3, 16])
def test_gemv_matches_reference(case, m):
    (block_n, block_k), group = CASES[case]
    n, k = 40, 96
    block_k = block_k or k
    qw, scale = weights(n, k, (block_n, block_k))
    x = activations(m, k, torch.float32, seed=2)
    bias = torch.randn(n).to(DEVICE)
    qa, sa = fp8_act_quant(x, group)
    out = fp8_gemv(qa, sa, group, qw, per_row(scale, n, block_n), 1, block_k, bias, torch.float32, rows_per_program=16)
    ref = fp8_linear_reference(x.cpu(), qw.cpu(), scale.cpu(), block_n, block_k, group, bias.cpu())
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_gemv_rows_do_not_depend_on_the_batch_size():
    qw, scale = weights(40, 64, (1, 64))
    x = activations(4, 64, torch.float32, seed=3)
    qa, sa = fp8_act_quant(x, 64)
    full = fp8_gemv(qa, sa, 64, qw, scale, 1, 64, None, torch.float32, rows_per_program=16)
    assert torch.equal(fp8_gemv(qa[:3], sa[:3], 64, qw, scale, 1, 64, None, torch.float32, rows_per_program=16),
                       full[:3])
    assert torch.equal(fp8_gemv(qa[1:2], sa[1:2], 64, qw, scale, 1, 64, None, torch.float32, rows_per_program=16),
                       full[1:2])


@pytest.mark.parametrize("case", list(CASES))
def test_gemm_matches_reference(case):
    (block_n, block_k), group = CASES[case]
    m, n, k = 20, 40, 96
    block_k = block_k or k
    qw, scale = weights(n, k, (block_n, block_k), seed=4)
    x = activations(m, k, torch.float16, seed=5)
    qa, sa = fp8_act_quant(x, group)
    out = fp8_gemm(qa, sa, group, qw, scale, block_n, block_k, None, torch.float32, config=SMALL_GEMM)
    ref = fp8_linear_reference(x.cpu(), qw.cpu(), scale.cpu(), block_n, block_k, group, out_dtype=torch.float32)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_k_step_stays_inside_groups_and_blocks():
    assert k_step(4096, 128, 128) == 128
    assert k_step(576, 576, 576) == 128  # per token, per channel: one group, the last step masked
    assert k_step(576, 64, 576) == 64
    assert k_step(256, 32, 128) == 32
    with pytest.raises(ValueError, match="common power-of-two step >= 32"):
        k_step(96, 16, 96)


def test_dequantized_weights_are_within_half_an_e4m3_step_of_the_originals():
    w = torch.randn(200, 300)
    q, scale = fp8_quantize_weight_reference(w, 128, 128)
    assert scale.shape == (2, 3)
    err = (fp8_dequantize_weight_reference(q, scale, 128, 128) - w).abs()
    subnormal_step = scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300] * 2.0**-9
    assert (err <= w.abs() / 16 + subnormal_step / 2 + 1e-7).all()


def test_fp8_linear_on_cpu_is_the_reference_and_keeps_leading_dims():
    qw, scale = weights(24, 64, (1, 64))
    x = torch.randn(2, 3, 64)
    out = fp8_linear(x.to(DEVICE), qw, scale, 1, 64, 32)
    assert out.shape == (2, 3, 24)
    if not x.is_cuda and DEVICE.type == "cpu":
        assert torch.equal(out, fp8_linear_reference(x.view(6, 64), qw, scale, 1, 64, 32).view(2, 3, 24))


@pytest.mark.parametrize("gated", [False, True])
def test_fused_gemv_gives_the_bits_of_act_quant_then_gemv(gated):
    from spmd_engine.kernels.fp8_gemv import fp8_gemv_fused

    k = 64
    qw, scale = weights(40, k, (1, 32), seed=6)
    x = activations(5, 2 * k if gated else k, torch.float16, seed=7)
    fused = fp8_gemv_fused(x, 32, qw, scale, 1, 32, None, torch.float32, gated=gated, rows_per_program=16)
    qa, sa = fp8_act_quant(x, 32, gated=gated)
    assert torch.equal(fused, fp8_gemv(qa, sa, 32, qw, scale, 1, 32, None, torch.float32, rows_per_program=16))
