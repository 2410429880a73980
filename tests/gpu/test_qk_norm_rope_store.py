"""The fused q/k norm + rotary + KV store on CUDA: bit for bit the unfused kernels (rms_norm_pair,
apply_rotary on q and on k, store_kv) at real attention shapes and every head grouping the token count
picks, and a triton-backend model whose logits do not move when the fusion is switched off.

The CPU interpreter cannot check the part that matters here: each head's RMSNorm sum must be reduced in
the same order as the pair kernel's one-warp reduction, which depends on the compiled layouts."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import spmd_engine.kernels.decode_rotary_attention as rotary_decode_module
from spmd_engine.kernels.kv_quant import FP8_DTYPE
from spmd_engine.kernels.qk_norm_rope_store import can_fuse, rows_per_program
from spmd_engine.models.layers.attention import Attention
from spmd_engine.models.loader import load_dummy_weights
from spmd_engine.models.parallel import TensorParallel
from spmd_engine.models.registry import build_model
from tests.gpu.engine_setup import GPU
from tests.kernels.test_qk_norm_rope_store import assert_same_bits, fused, make_layer, unfused
from tests.models.paged_runner import _metadata

pytestmark = GPU

# (Hq, Hkv, head_dim, norms): Qwen3-0.6B, Qwen3-8B at TP 2, Llama-3-8B, SmolLM2-135M, one rank each
SHAPES = [(16, 8, 128, True), (16, 4, 128, True), (32, 8, 128, False), (9, 3, 64, False), (9, 3, 64, True)]


@pytest.mark.parametrize("tokens", [1, 7, 64, 128, 256, 1024, 8192])
@pytest.mark.parametrize("hq,hkv,head_dim,norms", SHAPES)
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, FP8_DTYPE),
                                               (torch.float16, torch.float16)])
def test_fused_equals_the_unfused_kernels_bit_for_bit(tokens, hq, hkv, head_dim, norms, dtype, cache_dtype):
    layer = make_layer(tokens, hq, hkv, head_dim, dtype, cache_dtype, 16, norms, seed=tokens)
    for got, want, what in zip(fused(layer), unfused(layer), ("q", "k_cache", "v_cache")):
        assert_same_bits(got, want, f"{what} (heads per program {rows_per_program(tokens, hq, hkv, True)})")


@pytest.mark.parametrize("tokens", [1, 1024])
def test_wide_heads(tokens):
    """The widest head rows the fusion takes (D = 256)."""
    layer = make_layer(tokens, 8, 4, 256, torch.bfloat16, torch.bfloat16, 16, True, seed=tokens)
    for got, want, what in zip(fused(layer), unfused(layer), ("q", "k_cache", "v_cache")):
        assert_same_bits(got, want, what)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_float32_keeps_the_separate_kernels(head_dim):
    """Measured on the H200: the fused float32 results differ from the separate kernels' in the last bits,
    so a float32 model is not routed to the fusion (its tokens must not change)."""
    layer = make_layer(4, 8, 4, head_dim, torch.float32, torch.float32, 16, True, seed=1)
    assert not can_fuse(layer.q, layer.k, layer.v, layer.cos, layer.sin, True)


def test_every_grouping_is_exercised():
    """The token counts above cover every heads-per-program choice (1 .. 8) at the Qwen3-0.6B shape."""
    assert {rows_per_program(t, 16, 8, True) for t in (1, 7, 64, 128, 256, 1024, 8192)} == {1, 2, 4, 8}


def greedy_logits(model, prompts: list[list[int]], steps: int, cache_dtype: torch.dtype,
                  block_size: int = 16) -> list[torch.Tensor]:
    """Prefill every prompt in one batch, then `steps` greedy decode steps over a paged cache on CUDA (an fp8
    one with fixed per-head scales): the logits of each forward."""
    device, shape = torch.device("cuda"), model.shape
    per_seq = -(-(max(map(len, prompts)) + steps) // block_size)
    num_blocks = per_seq * len(prompts) + 3
    pool = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    tables = pool[: per_seq * len(prompts)].view(len(prompts), per_seq).to(torch.int32)
    heads = model.attention_layers()[0].num_kv_heads
    model.bind_kv_cache([tuple(torch.zeros(num_blocks, block_size, heads, shape.head_dim, dtype=cache_dtype,
                                           device=device) for _ in range(2)) for _ in range(shape.num_layers)])
    for i, layer in enumerate(model.attention_layers()):
        scales = None if cache_dtype != FP8_DTYPE else 0.02 * (1 + torch.arange(2 * heads, device=device) + i)
        layer.k_scale, layer.v_scale = (None, None) if scales is None else scales.float().split(heads)

    def forward(tokens: list[int], positions: list[list[int]], is_decode: bool) -> torch.Tensor:
        meta = _metadata(positions, tables, block_size, is_decode)
        meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.to(device),
                                   cu_seqlens_q=meta.cu_seqlens_q.to(device), seq_lens=meta.seq_lens.to(device),
                                   block_tables=meta.block_tables.to(device))
        flat = torch.tensor([p for pos in positions for p in pos], device=device)
        hidden = model(torch.tensor(tokens, device=device), flat, meta)
        return model.compute_logits(hidden)

    out = [forward([t for p in prompts for t in p], [list(range(len(p))) for p in prompts], False)]
    last = torch.stack([chunk[-1] for chunk in out[0].split([len(p) for p in prompts])])
    lengths = [len(p) for p in prompts]
    for _ in range(steps):
        out.append(forward(last.argmax(-1).tolist(), [[n] for n in lengths], True))
        last, lengths = out[-1], [n + 1 for n in lengths]
    model.bind_kv_cache([(None, None)] * shape.num_layers)
    for layer in model.attention_layers():
        layer.k_scale = layer.v_scale = None
    return out


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
@torch.inference_mode()
def test_model_logits_are_bit_identical_with_and_without_the_fusion(monkeypatch, arch, cache_dtype):
    """Prefill and greedy decode (the token chosen from each run's own logits: equal logits, equal tokens);
    decode steps prepare q/k inside decode attention on either cache, whichever ones the policy picks."""
    monkeypatch.setattr(rotary_decode_module, "ROTARY_IN_DECODE_CACHES", (cache_dtype,))
    launches = []
    kernel = rotary_decode_module.rotary_decode_attention
    monkeypatch.setattr(rotary_decode_module, "rotary_decode_attention",
                        lambda *args, **kwargs: launches.append(1) or kernel(*args, **kwargs))
    hf = {"architectures": [arch], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "eos_token_id": 1}
    prompts = [list(range(3, 40)), [7, 7, 60], list(range(100, 230))]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as the engine builds a bf16 model
    try:
        with torch.device("cuda"):
            model = build_model(hf, TensorParallel.single(), "triton")
    finally:
        torch.set_default_dtype(previous)
    load_dummy_weights(model, 0)
    fused_logits = greedy_logits(model, prompts, 6, cache_dtype)  # decode: q/k prepared inside decode attention
    assert len(launches) == 6 * 3  # every decode step's layers
    monkeypatch.setattr(Attention, "rotate_store_attend", lambda *args: None)  # the store kernel, then attention
    two_launch_logits = greedy_logits(model, prompts, 6, cache_dtype)
    monkeypatch.setattr(Attention, "rotate_and_store", lambda *args: None)  # norm, rotary, store apart
    unfused_logits = greedy_logits(model, prompts, 6, cache_dtype)
    assert len(launches) == 6 * 3
    assert len(fused_logits) == len(two_launch_logits) == len(unfused_logits) == 7
    for step, (got, two, want) in enumerate(zip(fused_logits, two_launch_logits, unfused_logits)):
        assert torch.equal(got, two), f"forward {step}: logits differ from the store kernel's path"
        assert torch.equal(got, want), f"forward {step}: logits differ from the unfused path"
