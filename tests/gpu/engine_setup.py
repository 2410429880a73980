"""Shared pieces of the GPU tests: a tiny bf16 checkpoint the Triton kernels accept, and engines on it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
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


REPO = Path(__file__).resolve().parents[2]
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MAX_TOKENS = 12  # greedy tokens per prompt in the multirun jobs


def multirun_jobs(ckpt: Path, out: Path, nproc: int, sweep: list[str], timeout: int = 480) -> list[tuple[dict, list]]:
    """One launch (`python run.py` or torchrun over `nproc` ranks), a Hydra multirun over `sweep` on the
    tiny checkpoint with the PROMPTS greedy: (metrics.json, token ids per prompt in order) per job."""
    prompts = out.parent / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in PROMPTS))
    launcher = [sys.executable, "run.py"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "run.py"]
    args = ["-m", *sweep, "model=qwen3", f"model.path={ckpt}", f"prompts_file={prompts}", "device=cuda",
            "sampling.temperature=0", f"sampling.max_tokens={MAX_TOKENS}", "sampling.ignore_eos=true",
            "num_kv_blocks=128", "max_model_len=256", "max_num_seqs=8", f"hydra.sweep.dir={out}", "log_level=WARNING"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env.update(NO_MULTICAST)
    proc = subprocess.run(launcher + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    jobs = []
    for job in sorted(p for p in out.iterdir() if p.is_dir()):
        rows = [json.loads(line) for line in (job / "outputs.jsonl").read_text().splitlines()]
        assert [r["error"] for r in rows] == [None] * len(PROMPTS)
        rows.sort(key=lambda r: r["index"])
        jobs.append((json.loads((job / "metrics.json").read_text()), [r["token_ids"] for r in rows]))
    return jobs
