"""Structured outputs' cost on throughput: the nano-vllm bench with 0 %, 10 % and 100 % of its requests
constrained to any JSON object (`{"json_object": true}`), back to back in one process, and compile times.

Model: Qwen3-0.6B's shape with random weights (`load_format=dummy`) and SmolLM2's tokenizer, the vocabulary
cut to the tokenizer's (49,152 tokens, so every logit column is a token the grammar knows); the prompts are
the bench's random token ids, `ignore_eos`, temperature 0.6, top_p 1. A random model writes a JSON string that
rarely closes, so most constrained requests still run to their max_tokens; those whose grammar ends earlier
finish "stop" (counted). Rows: fraction constrained, output tok/s, its ratio to the first 0 % run, output
tokens, constrained requests that stopped. The 0 % run is repeated last (the noise between two equal runs).
Then the compile time of each of a set of schemas (first compilation, nothing cached) and of the vocabulary.

Targets (issue 43): 100 % >= 0.80x the 0 % tok/s, 10 % >= 0.97x; 0 % within 1 % of main's
(`python run.py model=qwen3 model.load_format=dummy workload=bench` on both trees, `ab_trees.sh`). GPU:

    python launch/bench/bench_structured.py [--num-seqs 256] [--fractions 0 0.1 1 0]
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
from spmd_engine import LLM
from spmd_engine.job.workloads import bench_requests, run_bench_warmup
from spmd_engine.models.gguf import embedded_model_dir

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {
            "enum": ["a", "b", "c"]}}}, "required": ["id"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "email": {"type": "string"}, "roles": {"type": "array", "items": {"enum": ["admin", "viewer"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}},
        "required": ["email"]}}, "required": ["user"]},
]


def checkpoint_dir(tokenizer_dir: Path, out: Path) -> Path:
    """A config-and-tokenizer directory: Qwen3-0.6B's shape (conf/model/qwen3.yaml) at the tokenizer's vocabulary."""
    import yaml

    shape = yaml.safe_load((repo_root.ROOT / "conf" / "model" / "qwen3.yaml").read_text())["hf_config"]
    tokenizer_config = json.loads((tokenizer_dir / "config.json").read_text())
    shape.update(vocab_size=tokenizer_config["vocab_size"], bos_token_id=tokenizer_config.get("bos_token_id"),
                 eos_token_id=tokenizer_config.get("eos_token_id"), model_type="qwen3")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(shape))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.1, 1.0, 0.0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-len", type=int, default=1024, help="prompt and output lengths at most (CPU smoke: 16)")
    args = parser.parse_args()
    ckpt = checkpoint_dir(embedded_model_dir(), Path(tempfile.mkdtemp()) / "qwen3-shape")
    keys = {"device": args.device, "num_kv_blocks": 512, "max_model_len": 256} if args.device != "cuda" else {}
    llm = LLM(model=str(ckpt), load_format="dummy", **keys)
    try:
        run_bench_warmup(llm)
        warm = bench_requests({"num_seqs": 4, "min_input_len": 8, "max_input_len": 16, "min_output_len": 8,
                               "max_output_len": 16})
        for request in warm:  # the grammar path's first use (vocabulary read, fill threads) outside the timing
            request.overrides["structured_outputs"] = {"json_object": True}
        llm.stream(warm)
        base = None
        print(f"{'constrained':>11} {'out tok/s':>10} {'ratio':>6} {'out tokens':>10} {'stopped':>8}")
        for fraction in args.fractions:
            requests = bench_requests({"num_seqs": args.num_seqs, "min_input_len": min(100, args.max_len),
                                       "max_input_len": args.max_len, "min_output_len": min(100, args.max_len),
                                       "max_output_len": args.max_len})
            every = round(1 / fraction) if fraction > 0 else 0
            constrained = [r for i, r in enumerate(requests) if every and i % every == 0]
            for request in constrained:
                request.overrides["structured_outputs"] = {"json_object": True}
            start = time.perf_counter()
            outs = llm.stream(requests)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            rate = tokens / seconds
            base = rate if base is None else base
            stopped = sum(1 for o in outs if o.finish_reason == "stop")
            print(f"{len(constrained) / len(requests):>10.0%} {rate:>10,.0f} {rate / base:>6.3f} {tokens:>10,} "
                  f"{stopped:>8}", flush=True)
        pool = llm._grammars
        print(f"vocabulary read by xgrammar: {pool.vocabulary_seconds:.3f} s")
        for i, schema in enumerate(SCHEMAS):
            start = time.perf_counter()
            pool.submit(llm_params(schema)).result()
            print(f"schema {i} compile: {1000 * (time.perf_counter() - start):.1f} ms")
    finally:
        llm.close()


def llm_params(schema: dict):
    from spmd_engine import StructuredOutputsParams

    return StructuredOutputsParams(json=schema)


if __name__ == "__main__":
    main()
