import torch
import torch.nn.functional as F

from spmd_engine.models.layers.activation import SiluAndMul


def test_silu_of_gate_times_up():
    gate, up = torch.randn(4, 6), torch.randn(4, 6)
    out = SiluAndMul()(torch.cat([gate, up], dim=-1))
    assert out.shape == (4, 6)
    torch.testing.assert_close(out, F.silu(gate) * up)
