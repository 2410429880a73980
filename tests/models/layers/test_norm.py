import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from spmd_engine.models.layers.norm import RMSNorm


def _norms(hidden: int, dtype: torch.dtype) -> tuple[RMSNorm, Qwen3RMSNorm]:
    weight = torch.rand(hidden, generator=torch.Generator().manual_seed(0)) + 0.5
    ours, ref = RMSNorm(hidden, eps=1e-6).to(dtype), Qwen3RMSNorm(hidden, eps=1e-6).to(dtype)
    ours.weight.weight_loader(ours.weight, weight)
    ref.weight.data.copy_(weight)
    return ours, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers(dtype):
    ours, ref = _norms(48, dtype)
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(1)).to(dtype) * 3
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_add(dtype):
    ours, ref = _norms(48, dtype)
    gen = torch.Generator().manual_seed(2)
    x, residual = torch.randn(7, 48, generator=gen).to(dtype), torch.randn(7, 48, generator=gen).to(dtype)
    normed, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, residual + x, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref(residual + x), rtol=0, atol=0)


def test_initialised_to_identity_scale():
    x = torch.randn(3, 8)
    torch.testing.assert_close(RMSNorm(8, eps=0.0)(x), x / x.pow(2).mean(-1, keepdim=True).sqrt())
