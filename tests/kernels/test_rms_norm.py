import pytest
import torch

from spmd_engine.kernels.rms_norm import rms_norm, rms_norm_pair
from tests.kernels.paged_batch import DEVICE, gpu_case

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # triton interpreter noise


def reference(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, x


@pytest.mark.parametrize("rows,cols,dtype", [(5, 48, torch.float32), (3, 64, torch.float16),
                                             gpu_case(4096, 1024, torch.bfloat16)])
def test_plain_and_with_residual(rows, cols, dtype):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=gen).to(dtype).to(DEVICE)
    res = torch.randn(rows, cols, generator=gen).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(cols, generator=gen)).to(dtype).to(DEVICE)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(rms_norm(x, w, 1e-6), reference(x, w, 1e-6)[0], atol=tol, rtol=tol)
    out, summed = rms_norm(x, w, 1e-6, res)
    ref_out, ref_sum = reference(x, w, 1e-6, res)
    torch.testing.assert_close(summed, ref_sum, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)


@pytest.mark.parametrize("rows,cols,dtype", [(5, 48, torch.float32), gpu_case(4096, 1024, torch.bfloat16)])
def test_residual_out_may_be_the_residual_itself(rows, cols, dtype):
    """RMSNorm on CUDA updates the residual stream in place (`residual_out=residual`): the same bits as a
    new tensor, and a wrong-shaped destination is one clear error."""
    gen = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, cols, generator=gen).to(dtype).to(DEVICE)
    res = torch.randn(rows, cols, generator=gen).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(cols, generator=gen)).to(dtype).to(DEVICE)
    out, summed = rms_norm(x, w, 1e-6, res)
    stream = res.clone()
    out_in_place, summed_in_place = rms_norm(x, w, 1e-6, stream, residual_out=stream)
    assert summed_in_place.data_ptr() == stream.data_ptr()
    assert torch.equal(out_in_place, out) and torch.equal(stream, summed)
    with pytest.raises(ValueError, match="residual_out must be a contiguous"):
        rms_norm(x, w, 1e-6, res, residual_out=torch.empty(rows, cols + 1, dtype=dtype, device=DEVICE))


def test_per_head_norm_of_a_strided_qkv_slice():
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(4, 3 * 16 + 8, generator=gen).to(DEVICE)  # 3 heads of 16 + unrelated columns
    q = qkv[:, :48].reshape(4, 3, 16)
    w = torch.randn(16, generator=gen).to(DEVICE)
    out = rms_norm(q, w, 1e-6)
    assert out.shape == (4, 3, 16) and out.is_contiguous()
    torch.testing.assert_close(out, reference(q, w, 1e-6)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens,dtype", [(3, torch.float32), (2, torch.float16), gpu_case(5, torch.bfloat16)])
def test_q_and_k_head_norms_in_one_launch(tokens, dtype):
    """Qwen3's q norm (3 heads) and k norm (2 heads) on strided slices of one qkv row: the same bits
    as two rms_norm launches, each head with its own projection's weight."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 7 * 16, generator=gen).to(dtype).to(DEVICE)  # 3 q, 2 k, 2 v heads of 16
    q, k = qkv[:, :48].reshape(tokens, 3, 16), qkv[:, 48:80].reshape(tokens, 2, 16)
    wq, wk = (torch.randn(2, 16, generator=gen) + 1).to(dtype).to(DEVICE).unbind(0)
    out_q, out_k = rms_norm_pair(q, wq, k, wk, 1e-6)
    assert out_q.shape == (tokens, 3, 16) and out_k.shape == (tokens, 2, 16) and out_q.is_contiguous()
    assert torch.equal(out_q, rms_norm(q, wq, 1e-6)) and torch.equal(out_k, rms_norm(k, wk, 1e-6))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out_k, reference(k, wk, 1e-6)[0], atol=tol, rtol=tol)


def test_bad_weight_is_rejected():
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(torch.zeros(2, 8, device=DEVICE), torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="weights must be"):
        rms_norm_pair(torch.zeros(2, 3, 8, device=DEVICE), torch.ones(4, device=DEVICE),
                      torch.zeros(2, 1, 8, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6)
