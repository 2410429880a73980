import pytest
import torch

from spmd_engine.kernels.rotary import apply_rotary
from tests.kernels.paged_batch import DEVICE, gpu_case

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # triton interpreter noise


def reference(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos.float()[:, None], sin.float()[:, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


@pytest.mark.parametrize("tokens,heads,head_dim,dtype", [(5, 3, 16, torch.float32), (4, 2, 24, torch.float16),
                                                          gpu_case(512, 16, 128, torch.bfloat16)])
def test_matches_rotate_half_on_a_strided_view(tokens, heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(tokens)
    fused = torch.randn(tokens, (heads + 1) * head_dim, generator=gen).to(dtype).to(DEVICE)
    x = fused[:, head_dim:].reshape(tokens, heads, head_dim)  # like q after the qkv split
    angles = torch.randn(tokens, head_dim // 2, generator=gen)
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    out = apply_rotary(x, cos, sin)
    assert out.is_contiguous()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, reference(x, cos, sin), atol=tol, rtol=tol)


def test_odd_head_dim_is_rejected():
    with pytest.raises(ValueError, match="head_dim must be even"):
        apply_rotary(torch.zeros(2, 1, 7, device=DEVICE), torch.zeros(2, 3, device=DEVICE),
                     torch.zeros(2, 3, device=DEVICE))
