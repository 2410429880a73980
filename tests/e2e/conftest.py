"""Session fixtures of the end-to-end runs: tiny checkpoints and the real model's single-rank run."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.engine_args import REAL_PROMPT_ARGS
from tests.helpers.run_engine import EngineRun, run_engine
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Qwen3 with the byte-level tokenizer: 4 heads, 2 KV heads."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("e2e") / "tiny-qwen3", arch="qwen3",
                                max_position_embeddings=128)


@pytest.fixture(scope="session")
def tiny_qwen3_ids(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_qwen3's weights without its tokenizer, for token-id jobs that check no text: no rank then
    imports transformers (~1.3 s of CPU a process, `python -X importtime run.py ...`)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("e2e") / "tiny-qwen3-ids", arch="qwen3",
                                max_position_embeddings=128, tokenizer=False)


@pytest.fixture(scope="session")
def smollm2_single(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[EngineRun, Path]:
    """`python run.py` on the real SmolLM2 (greedy, the France prompt): the run and its job dir."""
    cwd = tmp_path_factory.mktemp("smollm2-single")
    job_dir = cwd / "job"
    run = run_engine([*REAL_PROMPT_ARGS, f"hydra.run.dir={job_dir}"], cwd, timeout_s=300).check()
    return run, job_dir
