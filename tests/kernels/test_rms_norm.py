import pytest
import torch

from spmd_engine.kernels.rms_norm import rms_norm
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


def test_per_head_norm_of_a_strided_qkv_slice():
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(4, 3 * 16 + 8, generator=gen).to(DEVICE)  # 3 heads of 16 + unrelated columns
    q = qkv[:, :48].reshape(4, 3, 16)
    w = torch.randn(16, generator=gen).to(DEVICE)
    out = rms_norm(q, w, 1e-6)
    assert out.shape == (4, 3, 16) and out.is_contiguous()
    torch.testing.assert_close(out, reference(q, w, 1e-6)[0], atol=1e-5, rtol=1e-5)


def test_bad_weight_is_rejected():
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(torch.zeros(2, 8, device=DEVICE), torch.ones(4, device=DEVICE), 1e-6)
