"""Four ranks on CPU (gloo): the widest tensor-parallel layout CI can run, identical to one rank.

8 query heads and 2 KV heads over 4 ranks: query heads split 2 per rank, each KV head replicated on
2 ranks, the vocabulary (300) padded to a multiple of 4; the stand-in for TP=4/8 on a GPU host.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.engine_args import TOKEN_PROMPTS, tiny_args, write_prompts_file
from tests.helpers.run_engine import generate_in_process, run_engine, token_ids
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint


@pytest.mark.slow
def test_four_ranks_match_one_rank(tmp_path: Path):
    ckpt = make_tiny_checkpoint(tmp_path / "tiny-h8-kv2", arch="qwen3", num_heads=8, num_kv_heads=2,
                                hidden_size=64, head_dim=16, intermediate_size=128, max_position_embeddings=128,
                                tokenizer=False)
    (tmp_path / "tmp").mkdir()
    prompts = write_prompts_file(tmp_path / "prompts.jsonl", [{"prompt_token_ids": p} for p in TOKEN_PROMPTS])
    args = tiny_args(ckpt, tmp_path / "job", prompts, block_size=4, max_num_batched_tokens=16,
                     num_kv_blocks=24, max_model_len=64, **{"sampling.max_tokens": 12})
    run_engine(args, tmp_path, timeout_s=300, nproc=4, env={"TMPDIR": str(tmp_path / "tmp")}).check()
    assert token_ids(tmp_path / "job") == generate_in_process(args)
