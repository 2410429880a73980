"""The small-batch GEMV on CUDA at real Qwen3 shapes: close to cuBLAS, rows independent of M, routed."""
import pytest
import torch

from spmd_engine.kernels.gemv import GEMV_MAX_M, gemv
from spmd_engine.kernels.silu_and_mul import silu_and_mul
from spmd_engine.models.layers.embedding import ParallelLMHead
from spmd_engine.models.layers.linear import matmul_fp32_out
from spmd_engine.models.parallel import TensorParallel
from tests.gpu.engine_setup import GPU
from tests.helpers.split_oracles import second_launch_reductions

pytestmark = GPU

# (N, K): Qwen3-0.6B qkv, o_proj, gate_up, down, LM head; Qwen3-8B qkv and down; a ragged shape
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024), (6144, 4096), (4096, 12288),
          (1000, 1000)]


def operands(n, k, dtype, rows=GEMV_MAX_M, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=gen).to(dtype)
    return x, w, b


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_cublas_and_rows_do_not_depend_on_m(n, k, dtype):
    x, w, b = operands(n, k, dtype)
    ref32 = torch.mm(x, w.t(), out_dtype=torch.float32) + b.float()
    full32 = gemv(x, w, b, out_dtype=torch.float32)
    assert ((full32 - ref32).abs().max() / ref32.abs().max()).item() < 1e-4  # both sum exact products in fp32
    full = gemv(x, w, b)
    torch.testing.assert_close(full, ref32.to(dtype), atol=2e-2, rtol=2e-2)
    for m in (1, 2, 3, 4, 8, 15):  # eager batches and the graphs they are padded to: the same bits per row
        assert torch.equal(gemv(x[:m], w, b), full[:m]), m
        assert torch.equal(gemv(x[:m], w, b, out_dtype=torch.float32), full32[:m]), m
    assert torch.equal(gemv(x, w, b), full)  # reruns too
    with second_launch_reductions():  # the split sum by the oracle's second launch: same bits
        assert torch.equal(gemv(x, w, b), full)


def test_split_sums_by_the_last_program_are_race_free():
    """Many calls of split-K shapes back to back (each N tile's last program sums the partials and
    resets its counter): every result is the same bits as the oracle's two-launch sum."""
    for n, k in [(1024, 3072), (4096, 1024)]:
        x, w, b = operands(n, k, torch.bfloat16, rows=7, seed=n)
        with second_launch_reductions() as second:
            expected = gemv(x, w, b, out_dtype=torch.float32)
        assert second.names == ["_gemv_kernel"], "a split-K shape"
        outs = [gemv(x, w, b, out_dtype=torch.float32) for _ in range(200)]
        assert all(torch.equal(o, expected) for o in outs)


@pytest.mark.parametrize("n,k", [(1024, 3072), (4096, 12288)])  # Qwen3-0.6B / 8B down_proj
def test_gated_down_proj_is_silu_and_mul_then_gemv(n, k):
    gate_up, _, _ = operands(1, 2 * k, torch.bfloat16, seed=2)  # [16, 2k]: gate | up
    _, w, b = operands(n, k, torch.bfloat16, seed=1)
    for m in (1, 3, 16):
        assert torch.equal(gemv(gate_up[:m], w, b, gated=True), gemv(silu_and_mul(gate_up[:m]), w, b)), m


def test_float32_activations_are_exact_enough():
    x, w, b = operands(512, 768, torch.float32, rows=5)
    torch.testing.assert_close(gemv(x, w, b), torch.addmm(b, x, w.t()), atol=1e-4, rtol=1e-4)


def test_lm_head_takes_the_gemv_at_small_batch_and_cublas_when_switched_off():
    with torch.device("cuda"):
        head = ParallelLMHead(151936, 1024, TensorParallel.single()).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.normal_(0, 0.03)
    hidden = torch.randn(3, 1024, device="cuda").to(torch.bfloat16)
    logits = head.compute_logits(hidden)
    assert logits.dtype == torch.float32 and torch.equal(logits, gemv(hidden, head.weight, out_dtype=torch.float32))
    head.small_batch_gemv = False
    assert torch.equal(head.compute_logits(hidden), matmul_fp32_out(hidden, head.weight))
    big = torch.randn(GEMV_MAX_M + 1, 1024, device="cuda").to(torch.bfloat16)
    head.small_batch_gemv = True
    assert torch.equal(head.compute_logits(big), matmul_fp32_out(big, head.weight))


def test_captured_in_a_cuda_graph():
    """Block choice and compilation happen before capture; the replay gives the eager bits."""
    x, w, b = operands(4096, 1024, torch.bfloat16, rows=4)
    eager = gemv(x, w, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gemv(x, w, b)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
