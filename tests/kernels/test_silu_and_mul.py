import pytest
import torch
import torch.nn.functional as F

from spmd_engine.kernels.silu_and_mul import silu_and_mul
from tests.kernels.paged_batch import DEVICE, gpu_case

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # triton interpreter noise


@pytest.mark.parametrize("rows,width,dtype", [(3, 40, torch.float32), (2, 1500, torch.float16),
                                              gpu_case(256, 3072, torch.bfloat16)])
def test_matches_silu_times_up(rows, width, dtype):
    x = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(rows)).to(dtype).to(DEVICE)
    gate, up = x.float().chunk(2, dim=-1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(silu_and_mul(x), (F.silu(gate) * up).to(dtype), atol=tol, rtol=tol)


def test_odd_width_is_rejected():
    with pytest.raises(ValueError, match=r"\[T, 2d\]"):
        silu_and_mul(torch.zeros(2, 5, device=DEVICE))
