"""In-process single-rank engines for the fault tests (no subprocess: a model builds in ~0.1 s)."""
from __future__ import annotations

from pathlib import Path

from spmd_engine.config import engine_config_from_dict
from spmd_engine.distributed import RankInfo
from spmd_engine.engine import Engine
from spmd_engine.job.outputs import RequestOutput
from spmd_engine.job.prompts import PromptRequest

SINGLE = RankInfo(0, 1, 0, "127.0.0.1", 0, "single")


def make_llm(ckpt: Path, **engine: object) -> Engine:
    """Greedy fp32 CPU engine over `ckpt`; `engine` adds or replaces top-level config keys."""
    raw = {"model": {"name": "tiny", "path": str(ckpt), "load_format": "auto", "hf_config": {}},
           "workload": {"name": "chat"},
           "sampling": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True},
           "device": "cpu", "dtype": "float32", "num_kv_blocks": 64, **engine}
    return Engine(engine_config_from_dict(raw), SINGLE)


def token_requests(prompts: list[list[int]], **overrides: object) -> list[PromptRequest]:
    return [PromptRequest(i, None, list(p), dict(overrides)) for i, p in enumerate(prompts)]


def greedy(ckpt: Path, prompts: list[list[int]], max_tokens: int, **engine: object) -> list[RequestOutput]:
    llm = make_llm(ckpt, **engine)
    try:
        return llm.generate(token_requests(prompts, max_tokens=max_tokens))
    finally:
        llm.close()
