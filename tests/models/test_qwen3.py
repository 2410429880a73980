import pytest
import torch

from spmd_engine.kernels import gemv as gemv_module
from spmd_engine.kernels.rms_norm import rms_norm
from spmd_engine.models.layers import linear as linear_module
from spmd_engine.models.parallel import TensorParallel
from spmd_engine.models.registry import build_model
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint
from tests.models.hf_parity import DYNAMIC, LLAMA3, NO_SCALING, YARN, assert_matches_hf

CASES = {
    "kv2-untied-plain": dict(num_kv_heads=2, tie=False, rope_scaling=NO_SCALING, rope_theta=1e6),
    "kv1-tied-yarn": dict(num_kv_heads=1, tie=True, rope_scaling=YARN),
    "kv2-tied-dynamic": dict(num_kv_heads=2, tie=True, rope_scaling=DYNAMIC),
    "kv1-untied-llama3-bias": dict(num_kv_heads=1, tie=False, rope_scaling=LLAMA3, attention_bias=True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_qwen3_logits_match_transformers(tmp_path, case):
    assert_matches_hf(make_tiny_checkpoint(tmp_path, arch="qwen3", tokenizer=False, **case))


def test_parity_check_catches_a_wrong_rope(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path, arch="qwen3", rope_scaling=YARN, tokenizer=False)
    with pytest.raises(AssertionError, match="relative error"):
        assert_matches_hf(checkpoint, config_override={"rope_parameters": {"rope_type": "default"}})



@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # triton interpreter noise
def test_decoder_norms_run_inside_the_projections_at_small_batch(monkeypatch):
    """On the GEMV route (here CPU under TRITON_INTERPRET) each decoder layer's residual add + norm runs in
    the prologue of qkv_proj's and gate_up_proj's GEMV: two launches fewer per layer, and every output of
    the layer halves is the bits of the unfused route (the rms_norm kernel, then the GEMV)."""
    tiny = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 512, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 50, "max_position_embeddings": 32}
    model = build_model(tiny, TensorParallel.single())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else noise / param.shape[-1] ** 0.5)
    model.half()
    monkeypatch.setattr(linear_module, "_gemv_device", lambda x: True)
    fused_calls, real = [], gemv_module.rms_norm_gemv
    monkeypatch.setattr(gemv_module, "rms_norm_gemv", lambda *a, **kw: fused_calls.append(1) or real(*a, **kw))
    hidden, cos_sin = model.model.embed(torch.tensor([3, 7, 11]), torch.tensor([0, 1, 2]))

    def run() -> list[torch.Tensor]:
        outputs, h, residual = [], hidden, None
        for layer in model.model.layers:
            q, k, v, residual = layer.before_attention(h, residual, cos_sin, None)  # no KV cache: nothing stored
            h, residual = layer.after_attention(q, residual)  # q stands in for the attention output
            outputs += [q, k, v, h, residual]
        return outputs

    fused = run()
    assert len(fused_calls) == 2 * 2  # input_layernorm + qkv_proj, post_attention_layernorm + gate_up_proj
    monkeypatch.setattr(linear_module, "use_rms_norm_gemv", lambda *args: False)
    for layer in model.model.layers:  # the unfused CUDA route: the rms_norm kernel, then the GEMV
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            monkeypatch.setattr(norm, "forward",
                                lambda x, residual=None, n=norm: rms_norm(x, n.weight, n.eps, residual))
    unfused = run()
    assert len(fused_calls) == 4
    for i, (a, b) in enumerate(zip(fused, unfused)):
        assert torch.equal(a, b), i
