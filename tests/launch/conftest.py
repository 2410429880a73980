"""Session fixtures for the launch tests: one tiny checkpoint and its single-process greedy tokens."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tiny_checkpoints import make_tiny_checkpoint
from tests.launch.engine_runs import single_process_run


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("launch") / "tiny-qwen3", arch="qwen3")


@pytest.fixture(scope="session")
def reference_tokens(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """Greedy tokens of a plain one-process run: what every launch path must reproduce."""
    tokens = single_process_run(tiny_ckpt, tmp_path_factory.mktemp("launch") / "single")
    assert len(tokens) == 2 and all(len(t) == 4 for t in tokens)
    return tokens
