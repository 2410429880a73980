"""Fixtures of the fault tests: one tiny checkpoint (no tokenizer: token-id prompts, faster starts)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tiny_checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="session")
def fault_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Qwen3: 4 heads, 2 KV heads, 128 positions, vocab 300, no tokenizer."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("faults") / "tiny-qwen3", arch="qwen3",
                                max_position_embeddings=128, tokenizer=False)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models on a 2-core machine: a second intra-op thread only adds contention."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
