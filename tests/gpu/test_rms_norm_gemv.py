"""The norm-GEMV (residual add + RMSNorm in the small-batch GEMV's prologue) on CUDA: the bits of the
rms_norm launch followed by the GEMV at Qwen3-0.6B's shapes, in CUDA graphs too, and the same greedy
tokens from an engine with the fusion on and off."""
import pytest
import torch

from spmd_engine.kernels.gemv import GEMV_MAX_M, gemv, gemv_config, rms_norm_gemv, rms_norm_gemv_exact
from spmd_engine.kernels.rms_norm import rms_norm
from spmd_engine.models.layers import linear as linear_module
from tests.gpu.engine_setup import GPU, PROMPTS, greedy_tokens, make_llm
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

pytestmark = GPU

# (N, K): Qwen3-0.6B qkv_proj and gate_up_proj (hidden 1024); a hidden of 512 and of 2048
EXACT_SHAPES = [(4096, 1024), (6144, 1024), (1000, 512), (3072, 2048)]
EPS = 1e-6


def operands(n, k, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (4 * torch.randn(GEMV_MAX_M, k, device="cuda", generator=gen)).to(dtype)
    res = (4 * torch.randn(GEMV_MAX_M, k, device="cuda", generator=gen)).to(dtype)
    norm_w = (1 + 0.2 * torch.randn(k, device="cuda", generator=gen)).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=gen).to(dtype)
    return x, res, norm_w, w, b


@pytest.mark.parametrize("n,k", EXACT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_is_rms_norm_then_gemv_bitwise(n, k, dtype):
    assert rms_norm_gemv_exact(k, gemv_config(n, k, 2))
    x, res, norm_w, w, b = operands(n, k, dtype, seed=n + k)
    for m in (1, 3, GEMV_MAX_M):
        normed, summed = rms_norm(x[:m], norm_w, EPS, res[:m])
        expected = gemv(normed, w, b)
        for one_launch in (True, False):
            out, new_res = rms_norm_gemv(x[:m], norm_w, EPS, w, res[:m], b, one_launch=one_launch)
            assert torch.equal(new_res, summed), (m, one_launch)
            assert torch.equal(out, expected), (m, one_launch)
        plain = rms_norm_gemv(x[:m], norm_w, EPS, w, None, b)  # the first layer: no residual
        assert torch.equal(plain, gemv(rms_norm(x[:m], norm_w, EPS), w, b)), m
        out32 = rms_norm_gemv(x[:m], norm_w, EPS, w, res[:m], out_dtype=torch.float32)[0]
        assert torch.equal(out32, gemv(normed, w, out_dtype=torch.float32)), m


def test_other_warp_counts_are_close_and_not_routed():
    """Qwen3-8B's hidden 4096: the norm kernel runs 8 warps, the GEMV 4, so the sums may differ in the last
    bit and the layers keep the two launches; the fused result is still the same norm to rounding."""
    n, k = 6144, 4096
    assert not rms_norm_gemv_exact(k, gemv_config(n, k, 2))
    x, res, norm_w, w, b = operands(n, k, torch.bfloat16, seed=3)
    normed, summed = rms_norm(x[:3], norm_w, EPS, res[:3])
    out, new_res = rms_norm_gemv(x[:3], norm_w, EPS, w, res[:3], b)
    assert torch.equal(new_res, summed)
    torch.testing.assert_close(out, gemv(normed, w, b), atol=5e-2, rtol=2e-2)
    assert not linear_module.use_rms_norm_gemv(x[:3], w, res[:3])
    assert linear_module.use_rms_norm_gemv(x[:3, :1024], w[:, :1024].contiguous(), res[:3, :1024])


def test_captured_in_a_cuda_graph():
    x, res, norm_w, w, b = operands(4096, 1024, torch.bfloat16, seed=5)
    eager = rms_norm_gemv(x[:4], norm_w, EPS, w, res[:4], b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = rms_norm_gemv(x[:4], norm_w, EPS, w, res[:4], b)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])


def test_engine_greedy_tokens_are_the_same_with_the_fusion_off(tmp_path, monkeypatch):
    """Decode steps (CUDA graphs, M <= 16) and the small piecewise buckets take the norm-GEMV at hidden 512;
    the engine's greedy tokens equal those of the two-launch route exactly (bf16)."""
    checkpoint = make_tiny_checkpoint(tmp_path / "ckpt", arch="qwen3", vocab_size=512, hidden_size=512, num_heads=8,
                                      num_kv_heads=2, head_dim=64, intermediate_size=1024, num_layers=2,
                                      max_position_embeddings=512, init_std=0.05, dtype=torch.bfloat16,
                                      tokenizer=False)
    calls, real = [], linear_module.use_rms_norm_gemv

    def counted(*args):
        fused = real(*args)
        calls.append(fused)
        return fused

    monkeypatch.setattr(linear_module, "use_rms_norm_gemv", counted)
    tokens = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(linear_module, "use_rms_norm_gemv", lambda *args: False)
        llm = make_llm(checkpoint, attention_backend="triton")
        try:
            tokens[fused] = greedy_tokens(llm, PROMPTS)
            assert llm.runner.graphs is not None and llm.runner.graphs.num_replays > 0
        finally:
            llm.close()
    assert any(calls), "no layer took the norm-GEMV"
    assert tokens[True] == tokens[False]
