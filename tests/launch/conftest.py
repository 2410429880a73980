"""Session fixtures for the launch tests: one tiny checkpoint and its single-rank greedy tokens."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.run_engine import generate_in_process
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint
from tests.launch.engine_runs import engine_args


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("launch") / "tiny-qwen3", arch="qwen3")


@pytest.fixture(scope="session")
def reference_tokens(tiny_ckpt: Path) -> list[list[int]]:
    """Greedy tokens of one rank on the same arguments, what every launch path must reproduce; built in
    this process (every launch test starts run.py itself), which spares a subprocess of ~4 s of CPU."""
    tokens = generate_in_process(engine_args(tiny_ckpt))
    assert len(tokens) == 2 and all(len(t) == 4 for t in tokens)
    return tokens
