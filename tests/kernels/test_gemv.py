"""The small-batch split-K GEMV against its float64 oracle, under TRITON_INTERPRET on CPU (tiny shapes)."""
import pytest
import torch

from spmd_engine.kernels import gemv as gemv_module
from spmd_engine.kernels.gemv import GEMV_MAX_M, GEMV_TABLE, GemvConfig, gemv, gemv_config
from spmd_engine.kernels.reference import linear_reference
from spmd_engine.kernels.silu_and_mul import silu_and_mul
from tests.helpers.split_oracles import second_launch_reductions
from tests.kernels.paged_batch import DEVICE

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # triton interpreter noise

# K=80 with 16-wide K steps in 3 splits: the last split holds one step, and 80 % 32 != 0 masks K
SPLIT3 = GemvConfig(block_n=16, block_k=16, split_k=3)
SPLIT3_RAGGED = GemvConfig(block_n=16, block_k=32, split_k=3)  # 80 = 32 + 32 + 16: the last step masked
WHOLE_K = GemvConfig(block_n=32, block_k=32, split_k=1)


def operands(m, n, k, dtype, seed=0, bias=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    return x, w, b


@pytest.mark.parametrize("config", [SPLIT3, SPLIT3_RAGGED, WHOLE_K], ids=["split3", "split3-ragged-k", "whole-k"])
@pytest.mark.parametrize("dtype,bias", [(torch.float32, False), (torch.float16, True)])
def test_matches_reference(config, dtype, bias):
    x, w, b = operands(3, 40, 80, dtype, bias=bias)  # N=40: a partial last N tile
    out = gemv(x, w, b, config=config)
    assert out.dtype == dtype and out.shape == (3, 40)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, linear_reference(x, w, b), atol=tol, rtol=tol)


@pytest.mark.parametrize("config", [SPLIT3, WHOLE_K], ids=["split3", "whole-k"])
def test_float32_out_from_half_inputs_is_not_rounded(config):
    x, w, b = operands(2, 48, 80, torch.float16, seed=1, bias=True)
    out = gemv(x, w, b, out_dtype=torch.float32, config=config)
    assert out.dtype == torch.float32
    ref = linear_reference(x, w, b, out_dtype=torch.float32)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)  # fp16 rounding would be ~1e-3 off
    assert not torch.equal(out, ref.half().float())


@pytest.mark.parametrize("config", [SPLIT3_RAGGED, WHOLE_K], ids=["split3-ragged-k", "whole-k"])
def test_rows_do_not_depend_on_the_batch_size(config):
    """Row i of M=1, 3 (eager) and 4 (a padded CUDA graph) are the same bits; so are reruns."""
    x, w, b = operands(4, 40, 80, torch.float32, seed=2, bias=True)
    full = gemv(x, w, b, config=config)
    assert torch.equal(gemv(x[:1], w, b, config=config), full[:1])
    assert torch.equal(gemv(x[:3], w, b, config=config), full[:3])
    assert torch.equal(gemv(x[2:3], w, b, config=config), full[2:3])
    assert torch.equal(gemv(x, w, b, config=config), full)


@pytest.mark.parametrize("config", [SPLIT3, SPLIT3_RAGGED], ids=["split3", "split3-ragged-k"])
def test_split_sum_in_one_launch_equals_the_second_launch(config):
    """The last program of an N tile adds the splits in the same order as the oracle's separate pass
    (tests/helpers/split_oracles.py), and leaves the arrival counters at zero for the next call."""
    x, w, b = operands(3, 40, 80, torch.float16, seed=4, bias=True)
    one = gemv(x, w, b, out_dtype=torch.float32, config=config)
    assert not gemv_module._COUNTERS[x.device].any()
    with second_launch_reductions() as second:
        two = gemv(x, w, b, out_dtype=torch.float32, config=config)
        two_half = gemv(x, w, b, config=config)
    assert second.names == ["_gemv_kernel"] * 2, "the split-K partials must be summed by the oracle"
    assert torch.equal(one, two)
    assert torch.equal(gemv(x, w, b, config=config), two_half)
    assert torch.equal(two_half, two.half())
    torch.testing.assert_close(one, linear_reference(x, w, b, torch.float32), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config", [SPLIT3_RAGGED, WHOLE_K], ids=["split3-ragged-k", "whole-k"])
def test_gated_input_is_silu_and_mul_fused(config):
    """A SwiGLU down_proj: x = gate | up; the same bits as the silu_and_mul launch followed by the GEMV."""
    gate_up, _, _ = operands(3, 1, 160, torch.float16, seed=5)
    _, w, b = operands(1, 40, 80, torch.float16, seed=6, bias=True)
    fused = gemv(gate_up, w, b, config=config, gated=True)
    assert torch.equal(fused, gemv(silu_and_mul(gate_up), w, b, config=config))
    with pytest.raises(ValueError, match="2K"):
        gemv(gate_up[:, :80], w, gated=True)


def test_default_config_and_leading_dims():
    x, w, _ = operands(4, 24, 40, torch.float32, seed=3)
    out = gemv(x.view(2, 2, 40), w)
    assert out.shape == (2, 2, 24)
    torch.testing.assert_close(out.view(4, 24), linear_reference(x, w), atol=1e-5, rtol=1e-5)


def test_block_choice_depends_only_on_the_shape():
    """Qwen3-0.6B shapes: the long-K projections split K, the LM head's tiles alone fill the GPU, and the
    measured table (GEMV_TABLE) overrides the heuristic: qkv (K = 1024) runs whole rows."""
    assert gemv_config(151936, 1024, 2).split_k == 1
    assert gemv_config(1024, 3072, 2).split_k > 1 and gemv_config(4096, 1024, 2) == GEMV_TABLE[(4096, 1024, 2)]
    assert gemv_config(4096, 1024, 4).split_k > 1  # float32 operands: the heuristic
    for n, k in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (6144, 4096), (4096, 12288), (40, 80)]:
        cfg = gemv_config(n, k, 2)
        assert cfg.block_k * (cfg.split_k - 1) < k and cfg.block_n >= 16 and cfg.block_k >= 16


def test_bad_calls_are_rejected():
    x, w, _ = operands(GEMV_MAX_M + 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="rows must be"):
        gemv(x, w)
    with pytest.raises(ValueError, match="share one of"):
        gemv(x[:2], w.half())
    with pytest.raises(ValueError, match="out_dtype"):
        gemv(x[:2].half(), w.half(), out_dtype=torch.bfloat16)
