import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from spmd_engine.models.layers.rope_config import RopeConfig
from spmd_engine.models.layers.rotary import RotaryEmbedding, apply_rotary, inverse_frequencies

HEAD_DIM, MAX_POS = 32, 256
ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                    "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn-explicit": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                      "attention_factor": 1.3, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def hf_config(rope: dict) -> LlamaConfig:
    return LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS,
                       rope_parameters={**rope, "rope_theta": 50_000.0})


@pytest.mark.parametrize("rope", ROPES.values(), ids=ROPES.keys())
def test_inverse_frequencies_match_transformers(rope):
    config = hf_config(rope)
    if rope["rope_type"] == "default":
        ref, ref_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        ref, ref_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    ours, factor = inverse_frequencies(RopeConfig.from_hf_config(config.to_dict()), HEAD_DIM)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-12)


@pytest.mark.parametrize("rope", ROPES.values(), ids=ROPES.keys())
def test_cos_sin_match_transformers_within_max_positions(rope):
    config = hf_config(rope)
    positions = torch.arange(MAX_POS)
    ref_cos, ref_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = RotaryEmbedding(HEAD_DIM, MAX_POS, RopeConfig.from_hf_config(config.to_dict()))(positions)
    half = HEAD_DIM // 2
    torch.testing.assert_close(cos, ref_cos[0, :, :half], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin[0, :, :half], rtol=1e-6, atol=1e-6)
    assert not torch.equal(cos[1:], cos[:-1])  # the angles really depend on the position


def test_dynamic_uses_static_ntk_base_beyond_max_positions():
    config = hf_config(ROPES["dynamic"])
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POS, RopeConfig.from_hf_config(config.to_dict()))
    plain, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    long, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=MAX_POS * 2)  # HF at factor * max
    positions = torch.tensor([0, 5, MAX_POS - 1, MAX_POS, MAX_POS + 7, 3 * MAX_POS])
    cos, sin = rotary(positions)
    inv = torch.where((positions >= MAX_POS)[:, None], long[None], plain[None])
    torch.testing.assert_close(cos, (positions[:, None].float() * inv).cos(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, (positions[:, None].float() * inv).sin(), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(long, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_matches_transformers(dtype):
    config = hf_config(ROPES["yarn"])
    positions = torch.tensor([0, 1, 2, 9, 100, 255])
    q = torch.randn(len(positions), 4, HEAD_DIM, generator=torch.Generator().manual_seed(0)).to(dtype)
    k = torch.randn(len(positions), 2, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref_cos, ref_sin = LlamaRotaryEmbedding(config)(q, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], ref_cos, ref_sin)
    cos, sin = RotaryEmbedding(HEAD_DIM, MAX_POS, RopeConfig.from_hf_config(config.to_dict()))(positions)
    torch.testing.assert_close(apply_rotary(q, cos, sin), ref_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k, cos, sin), ref_k[0].transpose(0, 1))
    assert apply_rotary(q, cos, sin).dtype == dtype


@pytest.mark.parametrize("rope", ROPES.values(), ids=ROPES.keys())
def test_tabulated_rows_are_the_computed_ones(rope):
    """The CUDA runner's tables (tests/gpu/test_rotary_tables.py checks the bits there): a step's rows
    are gathered from (cos, sin) made by `forward` over every position, in the activation dtype."""
    config = hf_config(rope)
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POS, RopeConfig.from_hf_config(config.to_dict()))
    positions = torch.tensor([0, 5, 3, 2 * MAX_POS - 1, MAX_POS, 1])
    computed = [t.to(torch.bfloat16) for t in rotary(positions)]
    assert rotary.rows(positions, torch.bfloat16)[0].equal(computed[0])  # no tables: computed
    rotary.tabulate(2 * MAX_POS, torch.bfloat16)
    table_cos, table_sin = rotary.tables
    assert table_cos.shape == (2 * MAX_POS, HEAD_DIM // 2) and table_cos.dtype == torch.bfloat16
    cos, sin = rotary.rows(positions, torch.bfloat16)
    assert cos.equal(table_cos[positions]) and sin.equal(table_sin[positions])
    assert cos.stride() == sin.stride() == (HEAD_DIM, 1)  # two views of one gathered row per position
    torch.testing.assert_close(cos, computed[0], atol=0, rtol=2 ** -7)  # bf16: within one rounding
    torch.testing.assert_close(sin, computed[1], atol=0, rtol=2 ** -7)
    assert rotary.rows(positions, torch.float32)[0].equal(rotary(positions)[0])  # another dtype: computed
