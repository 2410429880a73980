"""Llama and Qwen3 on the triton backend (TRITON_INTERPRET on CPU) take the fused q/k norm + rotary + KV
store kernel once a cache is bound, one launch per layer (on decode steps inside the decode attention launch),
and produce what the unfused path produces."""
from __future__ import annotations

import pytest
import torch

import spmd_engine.kernels.decode_rotary_attention as rotary_decode_module
import spmd_engine.kernels.qk_norm_rope_store as fused_module
from spmd_engine.models.layers.attention import Attention
from spmd_engine.models.loader import load_dummy_weights
from spmd_engine.models.parallel import TensorParallel
from spmd_engine.models.registry import build_model
from tests.models.paged_runner import run_paged

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # triton interpreter noise
              pytest.mark.skipif(torch.cuda.is_available(), reason="Triton on CPU tensors needs TRITON_INTERPRET")]

BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 101, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "eos_token_id": 1}
PROMPTS = [[5, 9, 17, 3, 44, 2, 8], [7, 7, 60], [11, 90, 23, 4, 4, 31, 12, 70, 15]]


def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model({**BASE, "architectures": [arch]}, TensorParallel.single(), "triton")
    load_dummy_weights(model, 0)
    with torch.no_grad():  # q and k norms far apart (dummy norms are all ~1): a swapped or dropped one shows
        for i, layer in enumerate(model.decoder_layers()):
            attention = layer.self_attn
            if hasattr(attention, "q_norm"):
                gen = torch.Generator().manual_seed(i)
                attention.q_norm.weight.copy_(torch.rand(16, generator=gen) + 0.5)
                attention.k_norm.weight.copy_(2 * torch.rand(16, generator=gen) + 0.1)
    return model


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_fused_path_matches_the_unfused_one(monkeypatch, arch):
    monkeypatch.setattr(rotary_decode_module, "ROTARY_IN_DECODE_CACHES", (torch.float32,))  # this test's cache
    model = build(arch)
    calls, decode_calls = [], []
    fused_kernel, decode_kernel = fused_module.qk_norm_rope_store, rotary_decode_module.rotary_decode_attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("q_weight", args[8] if len(args) > 8 else None) is not None)
        return fused_kernel(*args, **kwargs)

    def counting_decode(*args, **kwargs):
        decode_calls.append(kwargs.get("q_weight") is not None)
        return decode_kernel(*args, **kwargs)

    monkeypatch.setattr(fused_module, "qk_norm_rope_store", counting)
    monkeypatch.setattr(rotary_decode_module, "rotary_decode_attention", counting_decode)
    fused = run_paged(model, PROMPTS, num_steps=3)
    layers = len(model.decoder_layers())
    assert len(calls) == layers and len(decode_calls) == layers * 3  # prefill: the store kernel; decode: inside
    assert all(calls + decode_calls) == (arch == "Qwen3ForCausalLM") and any(calls) == all(calls)  # norms: Qwen3

    monkeypatch.setattr(Attention, "rotate_store_attend", lambda *args: None)  # the store kernel, then attention
    two_launches = run_paged(model, PROMPTS, num_steps=3, forced_tokens=fused.generated)
    assert len(calls) == layers * (1 + 4) and len(decode_calls) == layers * 3
    for got, want in zip(fused.decode_logits, two_launches.decode_logits):
        assert torch.equal(got, want)

    monkeypatch.setattr(Attention, "rotate_and_store", lambda *args: None)  # the separate norm/rotary/store
    unfused = run_paged(model, PROMPTS, num_steps=3, forced_tokens=fused.generated)
    for got, want in zip(fused.prefill_logits + fused.decode_logits, unfused.prefill_logits + unfused.decode_logits):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(calls) == layers * (1 + 4) and len(decode_calls) == layers * 3


def test_decode_steps_prepare_q_k_inside_attention_only_on_the_caches_named(monkeypatch):
    """By default only an fp8 cache's decode steps go through the rotary decode kernel (measured faster there);
    a 16/32-bit cache's run the store kernel, then decode attention."""
    assert rotary_decode_module.ROTARY_IN_DECODE_CACHES == (torch.float8_e4m3fn,)
    model = build("Qwen3ForCausalLM")
    calls, decode_calls = [], []
    fused_kernel, decode_kernel = fused_module.qk_norm_rope_store, rotary_decode_module.rotary_decode_attention
    monkeypatch.setattr(fused_module, "qk_norm_rope_store", lambda *a, **k: calls.append(1) or fused_kernel(*a, **k))
    monkeypatch.setattr(rotary_decode_module, "rotary_decode_attention",
                        lambda *a, **k: decode_calls.append(1) or decode_kernel(*a, **k))
    run_paged(model, PROMPTS, num_steps=2)
    layers = len(model.decoder_layers())
    assert len(calls) == layers * 3 and not decode_calls


class _CudaDecodeOnTorch:
    """Stands in for kernels/decode_attention_cuda on CPU: its `DecodePrologue` (`prepare` False: one that never
    fits, so the backend runs the store kernel first), and a kernel that does what the prologue promises with
    the Triton kernels the two-launch path runs (the store kernel on the raw q/k/v it was handed, then decode
    attention). Records the prologue of every call."""

    def __init__(self, prepare: bool) -> None:
        from spmd_engine.kernels import decode_attention_cuda

        class NeverFits(decode_attention_cuda.DecodePrologue):
            def fits(self, query) -> bool:
                return False

        self.DecodePrologue = decode_attention_cuda.DecodePrologue if prepare else NeverFits
        self.prologues: list = []

    @staticmethod
    def supports(query, k_cache, v_cache) -> bool:
        return True

    def paged_decode_attention_cuda(self, query, k_cache, v_cache, seq_lens, block_tables, scale, out=None, *,
                                    num_splits=None, prologue=None):
        from spmd_engine.kernels.decode_attention import paged_decode_attention

        self.prologues.append(prologue)
        if prologue is not None:
            assert prologue.fits(query)
            p = prologue
            query = fused_module.qk_norm_rope_store(query, p.k, p.v, p.cos, p.sin, k_cache, v_cache, p.slot_mapping,
                                                    p.q_weight, p.k_weight, p.eps)
        return paged_decode_attention(query, k_cache, v_cache, seq_lens, block_tables, scale)


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_decode_steps_hand_the_cuda_kernel_the_raw_projection_rows(monkeypatch, arch):
    """Where the prologue fits, a bf16/fp16 cache's decode step gives the CUDA kernel the qkv projection's raw
    q/k/v, the step's cos/sin and slots and the layer's q/k norm weights (Qwen3), and runs no store kernel first;
    the model's logits equal those of the store kernel followed by the kernel (a swapped, dropped or pre-rotated
    input would show)."""
    from spmd_engine.models.layers.attention import use_attention_backend
    from spmd_engine.models.layers.attention_backends.cuda_decode import CudaDecodeAttentionBackend, CudaDecodeKernel

    torch.manual_seed(0)
    model = build_model({**BASE, "head_dim": 128, "architectures": [arch]}, TensorParallel.single(), "triton")
    load_dummy_weights(model, 0)
    with torch.no_grad():
        for i, layer in enumerate(model.decoder_layers()):
            if hasattr(layer.self_attn, "q_norm"):
                gen = torch.Generator().manual_seed(i)
                layer.self_attn.q_norm.weight.copy_(torch.rand(128, generator=gen) + 0.5)
                layer.self_attn.k_norm.weight.copy_(2 * torch.rand(128, generator=gen) + 0.1)
    store_calls = []
    store_kernel = fused_module.qk_norm_rope_store
    monkeypatch.setattr(fused_module, "qk_norm_rope_store",
                        lambda *a, **k: store_calls.append(1) or store_kernel(*a, **k))
    layers = len(model.decoder_layers())
    runs = {}
    for prepare in (True, False):
        kernel = _CudaDecodeOnTorch(prepare)
        use_attention_backend(model, CudaDecodeAttentionBackend(
            CudaDecodeKernel(kernel, "paged_decode_attention_cuda", takes_scales=False)))
        store_calls.clear()
        runs[prepare] = run_paged(model, PROMPTS, num_steps=3, forced_tokens=runs[True].generated if runs else None)
        assert len(kernel.prologues) == layers * 3  # every decode step's layers through the kernel
        if prepare:
            # the store kernel: once per layer at prefill and, inside the stand-in, once per decode layer
            assert len(store_calls) == layers * (1 + 3)
            norms = [(p.q_weight, p.k_weight) for p in kernel.prologues[:layers]]
            if arch == "Qwen3ForCausalLM":
                for (q_weight, k_weight), layer in zip(norms, model.decoder_layers()):
                    assert q_weight is layer.self_attn.q_norm.weight and k_weight is layer.self_attn.k_norm.weight
            else:
                assert all(q is None and k is None for q, k in norms)
        else:
            assert all(p is None for p in kernel.prologues) and len(store_calls) == layers * (1 + 3)
    for got, want in zip(runs[True].decode_logits, runs[False].decode_logits):
        assert torch.equal(got, want)
