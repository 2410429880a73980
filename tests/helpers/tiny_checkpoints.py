"""Tiny random HF checkpoints (Qwen3 / Llama / Qwen2 / Mistral / Gemma 3) written with transformers itself, for tests.

They are real `save_pretrained` directories (config.json, model.safetensors,
generation_config.json and, optionally, a byte-level tokenizer with a chat template), so the
engine's loaders and end-to-end runs can be tested against transformers without any download.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHS = {"qwen3": "Qwen3Config", "llama": "LlamaConfig", "qwen3_moe": "Qwen3MoeConfig", "qwen2": "Qwen2Config",
         "mistral": "MistralConfig", "gemma3": "Gemma3TextConfig"}
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|bos|>", "<|eos|>", "<|pad|>"
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def make_tiny_checkpoint(
    tmp_dir: str | Path,
    arch: str = "qwen3",
    num_kv_heads: int = 2,
    tie: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    vocab_size: int = 300,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 64,
    rope_theta: float = 10_000.0,
    attention_bias: bool = False,
    mlp_bias: bool = False,
    init_std: float = 0.1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
    extra_config: dict[str, Any] | None = None,
    moe: dict[str, Any] | None = None,
) -> Path:
    """Write a random `arch` (one of ARCHS) checkpoint into `tmp_dir` and return the path.

    `extra_config`: more config keys, e.g. {"sliding_window": 8} (Mistral) or Gemma 3's
    {"sliding_window": 6, "layer_types": [...], "rope_local_base_freq": 100.0}.

    `rope_scaling` is an HF rope dict without rope_theta, e.g. {"rope_type": "yarn", "factor": 4.0,
    "original_max_position_embeddings": 16}. With `tokenizer`, token ids 0/1/2 are bos/eos/pad and
    id 3 + b is byte b (so vocab_size must be >= 259); eos_token_id is 1 either way.
    arch "qwen3_moe": `moe` holds the Qwen3MoeConfig keys (num_experts, num_experts_per_tok,
    moe_intermediate_size, norm_topk_prob, decoder_sparse_step, mlp_only_layers); defaults below.
    """
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    path = Path(tmp_dir)
    path.mkdir(parents=True, exist_ok=True)
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, attention_bias=attention_bias, initializer_range=init_std,
        rope_parameters={"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta},
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    if mlp_bias and arch != "llama":
        raise ValueError(f"{arch} has no mlp_bias")
    if arch in ("qwen2", "mistral", "gemma3") and attention_bias:
        raise ValueError(f"{arch} has no attention_bias key (Qwen2 always has q/k/v biases)")
    if arch in ("qwen2", "mistral"):
        del common["attention_bias"]
    if arch == "llama":
        common["mlp_bias"] = mlp_bias
    if arch == "gemma3":
        common.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=head_dim, sliding_window=None,
                      layer_types=["full_attention"] * num_layers)
        common.pop("rope_parameters")
        common.update(rope_theta=rope_theta)
    if arch == "qwen3_moe":
        common.update({**MOE_DEFAULTS, **(moe or {})})
    common.update(extra_config or {})
    config = getattr(transformers, ARCHS[arch])(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # HF initialises biases to zero; make them matter
        for name, param in model.named_parameters():
            if name.endswith(".bias") or (arch == "gemma3" and "norm" in name):  # Gemma norms start at 0
                param.normal_(0.0, init_std)
    model.save_pretrained(path)
    GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(path)
    if tokenizer:
        _save_byte_tokenizer(path, vocab_size)
    return path


MOE_DEFAULTS: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def _save_byte_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]
    if vocab_size < len(specials) + 256:
        raise ValueError(f"vocab_size must be >= {len(specials) + 256} for the byte tokenizer, "
                         f"got {vocab_size}")
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({symbol: len(specials) + byte for byte, symbol in enumerate(_byte_level_symbols())})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                      pad_token=PAD_TOKEN)
    wrapped.chat_template = TINY_CHAT_TEMPLATE
    wrapped.save_pretrained(path)


def _byte_level_symbols() -> list[str]:
    """The printable character the byte-level pre-tokenizer uses for each byte 0..255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    symbols, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + shifted)
            shifted += 1
    return [symbols[byte] for byte in range(256)]
