"""kv_cache_dtype=int8 through the engine (CPU, torch attention; Triton's: tests/spmd_engine/test_kv_int8_triton.py):
a row's quantization depends on that token's K/V alone, so chunked prefill, prefix-cache hits and preemption give
the tokens of a plain run; the key's errors; and (slow, SPMD_SLOW_TESTS=1) its teacher-forced top-1 agreement
on the real SmolLM2."""
import os
from pathlib import Path

import pytest
import torch

from tests.e2e.engine_args import TOKEN_PROMPTS, tiny_args, write_prompts_file
from tests.helpers.run_engine import generate_in_process

STRESS = {"block_size": 4, "max_num_batched_tokens": 8, "num_kv_blocks": 16, "max_model_len": 64}


def test_int8_tokens_do_not_depend_on_the_schedule(tiny_qwen3_ids: Path, tmp_path: Path):
    prompts = write_prompts_file(tmp_path / "p.jsonl", [{"prompt_token_ids": p} for p in TOKEN_PROMPTS])
    plain = generate_in_process(tiny_args(tiny_qwen3_ids, None, prompts, kv_cache_dtype="int8",
                                          enable_prefix_caching="false", **{"sampling.max_tokens": 12}))
    stressed = generate_in_process(tiny_args(tiny_qwen3_ids, None, prompts, kv_cache_dtype="int8",
                                             **{**STRESS, "sampling.max_tokens": 12}))
    assert [len(t) for t in plain] == [12] * len(TOKEN_PROMPTS)
    assert stressed == plain


def test_int8_key_errors_are_one_line():
    from spmd_engine.config import ConfigError, engine_config_from_dict
    from spmd_engine.llm import compose_config

    engine_config_from_dict(compose_config("qwen3", {"kv_cache_dtype": "int8",
                                                     "attention_backend": "triton"})).validate(1)  # CUDA's
    with pytest.raises(ConfigError, match=r"^kv_cache_dtype must be one of auto\|fp8\|int8, got 'int4'$"):
        engine_config_from_dict(compose_config("qwen3", {"kv_cache_dtype": "int4"})).validate(1)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SPMD_SLOW_TESTS") != "1", reason="set SPMD_SLOW_TESTS=1 (1.5-6 min on 2 cores)")
def test_int8_cache_agrees_with_the_unquantized_cache_on_smollm2(smollm2_dir: Path):
    """Teacher-forced top-1 over 4 real texts x 512 tokens, each prefilled through the cache (every position
    attends over stored, quantized K/V): >= 99 % agreement with a float32 cache (docs/PERFORMANCE.md)."""
    import inspect
    import json
    import textwrap
    from json import decoder

    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    from spmd_engine.executor.kv_cache import KVCacheSpec, allocate_kv_cache
    from spmd_engine.models.loader import load_safetensors_weights
    from spmd_engine.models.parallel import TensorParallel
    from spmd_engine.models.registry import build_model
    from tests.models.paged_runner import _metadata

    texts = [topics["execmodel"], topics["compound"], inspect.getsource(textwrap), inspect.getsource(decoder)]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    seqs = [tokenizer.encode(t, add_special_tokens=False)[:512] for t in texts]
    model = build_model(json.loads((smollm2_dir / "config.json").read_text()), TensorParallel.single(), "torch")
    load_safetensors_weights(model, smollm2_dir)
    model.eval()
    shape = model.shape

    def top1(dtype: torch.dtype) -> torch.Tensor:
        spec = KVCacheSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim, 16, dtype)
        out = []
        for seq in seqs:
            blocks = -(-len(seq) // 16)
            model.bind_kv_cache(allocate_kv_cache(spec, blocks, torch.device("cpu")))
            tables = torch.arange(blocks, dtype=torch.int32)[None]
            with torch.inference_mode():
                hidden = model(torch.tensor(seq), torch.arange(len(seq)),
                               _metadata([list(range(len(seq)))], tables, 16, False))
                out.append(model.compute_logits(hidden)[:-1].argmax(-1))
            model.bind_kv_cache([(None, None)] * shape.num_layers)
        return torch.cat(out)

    agreement = (top1(torch.int8) == top1(torch.float32)).float().mean().item()
    print(f"int8 KV top-1 agreement: {agreement:.4%}")
    assert agreement >= 0.99
