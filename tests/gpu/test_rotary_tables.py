"""The runner's rotary tables on CUDA: a step's gathered (cos, sin) rows are bit for bit the ones the
model computed per step before (`RotaryEmbedding.forward` over the step's positions), one gather for both."""
import pytest
import torch

from spmd_engine.models.layers.rope_config import RopeConfig
from spmd_engine.models.layers.rotary import RotaryEmbedding
from tests.gpu.engine_setup import GPU

pytestmark = GPU

ROPES = {
    "default": RopeConfig(theta=1e6),
    "llama3": RopeConfig(rope_type="llama3", theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=8192),
    "yarn": RopeConfig(rope_type="yarn", theta=1e6, factor=4.0, original_max_position_embeddings=4096),
    "dynamic": RopeConfig(rope_type="dynamic", theta=1e4, factor=2.0),
}


@pytest.mark.parametrize("rope", ROPES.values(), ids=ROPES.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gathered_rows_are_the_computed_bits(rope, dtype):
    with torch.device("cuda"):
        rotary = RotaryEmbedding(128, 2048, rope)
    max_len = 6000  # past max_position_embeddings: the dynamic rope's long base too
    gen = torch.Generator(device="cuda").manual_seed(0)
    steps = [torch.arange(max_len, device="cuda"),  # every position, one step
             torch.randint(0, max_len, (257,), device="cuda", generator=gen),  # a decode step's rows
             torch.zeros(16, dtype=torch.long, device="cuda")]  # padding rows
    computed = [[t.to(dtype) for t in rotary(positions)] for positions in steps]
    rotary.tabulate(max_len, dtype)
    for positions, (cos, sin) in zip(steps, computed):
        got_cos, got_sin = rotary.rows(positions, dtype)
        assert got_cos.equal(cos) and got_sin.equal(sin)
        # one gathered row per position: cos and sin are its two halves (what every rotary kernel takes)
        assert got_sin.stride() == got_cos.stride() == (128, 1)
        assert got_sin.data_ptr() == got_cos.data_ptr() + 64 * got_cos.element_size()
