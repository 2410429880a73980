"""A tiny Qwen3-MoE through torchrun on 2 CPU ranks, for both expert splits, under prefix caching, chunked prefill
and recompute preemption: the tokens of one rank."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.engine_args import TOKEN_PROMPTS, tiny_args, write_prompts_file
from tests.helpers.run_engine import generate_in_process, run_engines, token_ids
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

STRESS = {"block_size": 4, "max_num_batched_tokens": 8, "num_kv_blocks": 16, "max_model_len": 64}
SPLITS = ("experts", "intermediate")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SPMD_SLOW_TESTS") != "1", reason="~40 s on 2 cores: set SPMD_SLOW_TESTS=1")
def test_two_ranks_match_one_rank_for_both_splits(tmp_path: Path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", arch="qwen3_moe", max_position_embeddings=128, tokenizer=False,
                                moe=dict(num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1]))
    (tmp_path / "tmp").mkdir()
    prompts = write_prompts_file(tmp_path / "prompts.jsonl", [{"prompt_token_ids": p} for p in TOKEN_PROMPTS])
    args = {split: tiny_args(ckpt, tmp_path / f"job-{split}", prompts, model="qwen3_moe", moe_tp_split=split,
                             **STRESS) for split in SPLITS}
    runs = run_engines(list(args.values()), tmp_path, timeout_s=300, nproc=2, env={"TMPDIR": str(tmp_path / "tmp")})
    for run in runs:
        run.check()
    expected = generate_in_process(args["experts"])
    for split in SPLITS:
        assert token_ids(tmp_path / f"job-{split}") == expected, split
