"""Shared pieces of the GPU tests: a tiny bf16 checkpoint the Triton kernels accept, and engines on it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmd_engine.config import engine_config_from_dict
from spmd_engine.distributed import RankInfo
from spmd_engine.engine import Engine
from spmd_engine.job.prompts import PromptRequest
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SINGLE = RankInfo(0, 1, 0, "127.0.0.1", 0, "single")
PROMPTS = [[5, 6, 7], list(range(40, 75)), [9] * 20 + [11], list(range(100, 117)), [300 + i for i in range(60)]]


def tiny_bf16_checkpoint(path: Path) -> Path:
    """Qwen3 layout, head_dim 64 (a Triton kernel shape), bf16 weights; no tokenizer."""
    return make_tiny_checkpoint(path, arch="qwen3", vocab_size=512, hidden_size=256, num_heads=4, num_kv_heads=2,
                                head_dim=64, intermediate_size=512, num_layers=2, max_position_embeddings=512,
                                init_std=0.05, dtype=torch.bfloat16, tokenizer=False)


def engine_overrides(**engine: object) -> dict:
    return {"device": "cuda", "dtype": "bfloat16", "max_num_seqs": 8, "max_model_len": 256,
            "num_kv_blocks": 128, "log_level": "WARNING", **engine}


def make_llm(path: Path, **engine: object) -> Engine:
    raw = {"model": {"name": "tiny", "path": str(path), "load_format": "auto", "hf_config": {}},
           "workload": {"name": "chat"}, "sampling": {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True},
           **engine_overrides(**engine)}
    return Engine(engine_config_from_dict(raw), SINGLE)


def greedy_tokens(llm: Engine, prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
    outs = llm.generate([PromptRequest(i, None, p, {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True})
                         for i, p in enumerate(prompts)])
    assert [o.error for o in outs] == [None] * len(prompts)
    return [o.token_ids for o in outs]
