"""Command-line arguments shared by the end-to-end tests (one place, so runs compare like with like)."""
from __future__ import annotations

import json
from pathlib import Path

FRANCE = "What is the capital of France? Answer in one sentence."
# the README's first command, verbatim (plus hydra.run.dir)
REAL_PROMPT_ARGS = [f"prompts={json.dumps([FRANCE])}", "sampling.temperature=0", "sampling.max_tokens=32"]
SHARED = list(range(40, 60))  # a 20-token prefix shared by two prompts
TOKEN_PROMPTS = [[5, 6, 7], SHARED + [100, 101, 102, 103, 104], [9] * 10 + [11], SHARED + list(range(200, 211)),
                 list(range(20, 45))]  # 3, 25, 11, 31 and 25 tokens


def write_prompts_file(path: Path, rows: list[dict | str]) -> Path:
    """A JSONL prompts_file: dict rows as JSON, str rows verbatim (to write malformed lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def tiny_args(ckpt: Path, job_dir: Path | None, prompts_file: Path, **keys: object) -> list[str]:
    """Greedy, float32, CPU run of a tiny checkpoint into `job_dir` (None: Hydra's default dir);
    `keys` add or replace keys."""
    base = {"model": "qwen3", "model.path": ckpt, "prompts_file": prompts_file, "device": "cpu",
            "dtype": "float32", "sampling.temperature": 0, "sampling.max_tokens": 32,
            "sampling.ignore_eos": "true", "num_kv_blocks": 256, "dist_timeout_s": 60,
            "hydra.run.dir": job_dir}
    base.update(keys)
    if job_dir is None:
        del base["hydra.run.dir"]
    return [f"{k}={v}" for k, v in base.items()]
