"""Where a job's requests come from: the chat workload (prompts / prompts_file / built-ins) or
the nano-vllm benchmark (seeded random token prompts, reproducible to the token)."""
from __future__ import annotations

import logging
import random

from spmd_engine.config import EngineConfig
from spmd_engine.job.prompts import DEFAULT_PROMPTS, PromptRequest, read_prompts, tokenize

log = logging.getLogger("spmd_engine")
TOKEN_PROMPT_LENS = (8, 32)  # token-id stand-ins for the built-in prompts: about their length in tokens
TOKEN_PROMPT_ID_MAX = 10000  # as the bench workload draws them (and inside any real vocabulary)


def build_requests(cfg: EngineConfig, tokenizer, vocab_size: int) -> list[PromptRequest]:
    if cfg.workload.name == "bench":
        return bench_requests(cfg.workload.params)
    if cfg.prompts is None and cfg.prompts_file is None:
        if tokenizer is None:
            return default_token_requests(cfg.seed, vocab_size)
        requests = read_prompts(list(DEFAULT_PROMPTS), None)
    else:
        requests = read_prompts(cfg.prompts, cfg.prompts_file)
    tokenize(requests, tokenizer, cfg.chat_template, cfg.chat_template_kwargs)
    return requests


def default_token_requests(seed: int, vocab_size: int) -> list[PromptRequest]:
    """The built-in chat prompts for a model without a tokenizer (dummy weights of a shape): seeded random
    token ids, one request per built-in prompt, so that the documented dummy command generates instead of
    failing every request on text it cannot tokenize."""
    rng = random.Random(seed)
    top = max(1, min(vocab_size, TOKEN_PROMPT_ID_MAX))
    prompts = [[rng.randrange(top) for _ in range(rng.randint(*TOKEN_PROMPT_LENS))] for _ in DEFAULT_PROMPTS]
    log.info("the model has no tokenizer: the %d built-in chat prompts run as seeded random token-id prompts "
             "(%d-%d tokens); for your own, give prompts_file lines {\"prompt_token_ids\": [...]} or a model.path "
             "with a tokenizer", len(prompts), *TOKEN_PROMPT_LENS)
    return [PromptRequest(i, None, ids) for i, ids in enumerate(prompts)]


def bench_requests(params: dict) -> list[PromptRequest]:
    """The nano-vllm bench.py workload: all prompts drawn first, then all output lengths."""
    rng = random.Random(params.get("random_seed", 0))
    num_prompts = int(params.get("num_seqs", 256))
    lo_in, hi_in = int(params.get("min_input_len", 100)), int(params.get("max_input_len", 1024))
    lo_out, hi_out = int(params.get("min_output_len", 100)), int(params.get("max_output_len", 1024))
    top = int(params.get("token_id_max", 10000))
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(lo_in, hi_in))] for _ in range(num_prompts)]
    max_tokens = [rng.randint(lo_out, hi_out) for _ in range(num_prompts)]
    # nano-vllm samples with temperature alone (top_p 1, top_k off), whatever sampling.* or a checkpoint's
    # generation_config says; workload.top_p / workload.top_k measure the other sampling paths
    overrides = {"temperature": float(params.get("temperature", 0.6)), "top_p": float(params.get("top_p", 1.0)),
                 "top_k": int(params.get("top_k", -1)), "ignore_eos": True, "min_p": 0.0, "repetition_penalty": 1.0}
    n = int(params.get("n", 1))  # completions per prompt (workload=bench_n)
    if n > 1 and params.get("n_as_separate_requests", False):  # the same work as n lines of one prompt each
        return [PromptRequest(i * n + k, None, p, {**overrides, "max_tokens": m})
                for i, (p, m) in enumerate(zip(prompts, max_tokens)) for k in range(n)]
    if n > 1:
        overrides["n"] = n
    return [PromptRequest(i, None, p, {**overrides, "max_tokens": m})
            for i, (p, m) in enumerate(zip(prompts, max_tokens))]


def run_bench_warmup(llm) -> None:
    """One short untimed request through `llm` (an `LLM`), so compilation and first-touch costs stay
    out of the timing."""
    llm.stream([PromptRequest(0, None, list(range(1, 17)), {"max_tokens": 8, "ignore_eos": True})])
