"""Where a job's requests come from: the chat workload (prompts / prompts_file / built-ins) or
the nano-vllm benchmark (seeded random token prompts, reproducible to the token)."""
from __future__ import annotations

import random

from spmd_engine.config import EngineConfig
from spmd_engine.prompts import DEFAULT_PROMPTS, PromptRequest, read_prompts, tokenize


def build_requests(cfg: EngineConfig, tokenizer, vocab_size: int) -> list[PromptRequest]:
    if cfg.workload.name == "bench":
        return bench_requests(cfg.workload.params)
    if cfg.prompts is None and cfg.prompts_file is None:
        requests = read_prompts(list(DEFAULT_PROMPTS), None)
    else:
        requests = read_prompts(cfg.prompts, cfg.prompts_file)
    tokenize(requests, tokenizer, cfg.chat_template)
    return requests


def bench_requests(params: dict) -> list[PromptRequest]:
    """The nano-vllm bench.py workload: all prompts drawn first, then all output lengths."""
    rng = random.Random(params.get("random_seed", 0))
    n = int(params.get("num_seqs", 256))
    lo_in, hi_in = int(params.get("min_input_len", 100)), int(params.get("max_input_len", 1024))
    lo_out, hi_out = int(params.get("min_output_len", 100)), int(params.get("max_output_len", 1024))
    top = int(params.get("token_id_max", 10000))
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(lo_in, hi_in))] for _ in range(n)]
    max_tokens = [rng.randint(lo_out, hi_out) for _ in range(n)]
    # nano-vllm samples with temperature alone: no nucleus or top-k, whatever sampling.* says
    overrides = {"temperature": float(params.get("temperature", 0.6)), "top_p": 1.0, "top_k": -1,
                 "ignore_eos": True}
    return [PromptRequest(i, None, p, {**overrides, "max_tokens": m}) for i, (p, m) in enumerate(zip(prompts, max_tokens))]


def run_bench_warmup(llm) -> None:
    """One short untimed request, so compilation and first-touch costs stay out of the timing."""
    llm.generate([PromptRequest(0, None, list(range(1, 17)), {"max_tokens": 8, "ignore_eos": True})])
