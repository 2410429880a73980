"""quantization=fp8 under torchrun (slow, SPMD_SLOW_TESTS=1): an FP8 block-scaled checkpoint on 2 tensor-parallel
ranks, with chunked prefill, prefix-cache hits and preemption, gives the greedy tokens of one rank."""
import os
from pathlib import Path

import pytest

from tests.e2e.engine_args import TOKEN_PROMPTS, tiny_args, write_prompts_file
from tests.helpers.fp8_checkpoints import write_fp8_checkpoint
from tests.helpers.run_engine import generate_in_process, run_engine, token_ids
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

STRESS = {"block_size": 4, "max_num_batched_tokens": 8, "num_kv_blocks": 16, "max_model_len": 64}


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SPMD_SLOW_TESTS") != "1", reason="set SPMD_SLOW_TESTS=1 (about 1 min)")
def test_fp8_checkpoint_on_two_ranks_gives_one_rank_tokens(tmp_path: Path):
    src = make_tiny_checkpoint(tmp_path / "src", arch="qwen3", hidden_size=256, intermediate_size=512, num_heads=4,
                               head_dim=64, num_kv_heads=2, vocab_size=300, max_position_embeddings=128,
                               tokenizer=False)
    fp8 = write_fp8_checkpoint(src, tmp_path / "fp8")
    (tmp_path / "tmp").mkdir()
    prompts = write_prompts_file(tmp_path / "p.jsonl", [{"prompt_token_ids": p} for p in TOKEN_PROMPTS])
    args = tiny_args(fp8, tmp_path / "job", prompts, **STRESS, **{"sampling.max_tokens": 16})
    run = run_engine(args, tmp_path, timeout_s=300, nproc=2, env={"TMPDIR": str(tmp_path / "tmp")}).check()
    assert "quantization: fp8 e4m3 weights (128x128 blocks, checkpoint)" in run.stdout + run.stderr
    assert token_ids(tmp_path / "job") == generate_in_process(args)
