"""logprobs / prompt_logprobs equal HF's float32 log-softmax of the raw logits (before temperature)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from spmd_engine.config import engine_config_from_dict
from spmd_engine.distributed import RankInfo
from spmd_engine.engine import Engine
from spmd_engine.executor.logprobs import prompt_logit_rows
from spmd_engine.job.prompts import PromptRequest
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

SINGLE = RankInfo(0, 1, 0, "127.0.0.1", 0, "single")
PROMPTS = [list(range(10, 31)), [7, 8, 9]]  # 21 tokens (chunked at 8), 3 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("lp") / "ckpt", max_position_embeddings=128,
                                tokenizer=False)


def _llm(path: Path, **engine) -> Engine:
    raw = {"model": {"name": "t", "path": str(path), "load_format": "auto", "hf_config": {}},
           "workload": {"name": "chat"}, "sampling": {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True},
           "device": "cpu", "dtype": "float32", "num_kv_blocks": 64, "block_size": 4, **engine}
    return Engine(engine_config_from_dict(raw), SINGLE)


def _hf_logprobs(path: Path, ids: list[int]) -> torch.Tensor:
    """HF's float32 log-softmax at every position of `ids` (row p predicts token p + 1)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_prompt_logit_rows_take_each_sequences_leading_tokens():
    rows = prompt_logit_rows(np.array([3, 1, 4]), np.array([2, 0, 3]))
    assert rows.tolist() == [0, 1, 4, 5, 6]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_logprobs_and_prompt_logprobs_equal_hf(tiny, async_scheduling, monkeypatch):
    monkeypatch.setattr("spmd_engine.executor.logprobs.LOGPROB_ROWS_PER_CHUNK", 3)  # several row chunks per step
    llm = _llm(tiny, async_scheduling=async_scheduling, max_num_batched_tokens=8, enable_prefix_caching=True)
    try:
        llm.generate([PromptRequest(0, None, PROMPTS[0])])  # fills the prefix cache: prompt logprobs must skip it
        outs = llm.generate([
            PromptRequest(0, None, PROMPTS[0], {"logprobs": 3, "prompt_logprobs": 2}),
            PromptRequest(1, None, PROMPTS[1], {"logprobs": 0, "temperature": 0.8, "seed": 5}),
            PromptRequest(2, None, PROMPTS[1]),
        ])
    finally:
        llm.close()
    asked, sampled, plain = outs
    assert plain.logprobs is None and plain.prompt_logprobs is None and "logprobs" not in plain.to_json()
    assert sampled.prompt_logprobs is None
    for out, k in ((asked, 3), (sampled, 0)):
        ids = out.prompt_token_ids + out.token_ids
        ref = _hf_logprobs(tiny, ids)
        assert len(out.logprobs) == len(out.token_ids)
        for i, item in enumerate(out.logprobs):
            row = ref[len(out.prompt_token_ids) - 1 + i]
            assert item["token_id"] == out.token_ids[i]
            assert abs(item["logprob"] - row[item["token_id"]].item()) < 1e-4  # raw: before temperature
            top = row.topk(k)
            assert [t["token_id"] for t in item["top_logprobs"]] == top.indices.tolist()
            assert np.allclose([t["logprob"] for t in item["top_logprobs"]], top.values.numpy(), atol=1e-4)
            if out is asked:  # greedy: the chosen token is the top one
                assert item["logprob"] == item["top_logprobs"][0]["logprob"]
    ref = _hf_logprobs(tiny, PROMPTS[0])
    assert asked.prompt_logprobs[0] is None and len(asked.prompt_logprobs) == len(PROMPTS[0])
    for p in range(1, len(PROMPTS[0])):
        item = asked.prompt_logprobs[p]
        assert item["token_id"] == PROMPTS[0][p]
        assert abs(item["logprob"] - ref[p - 1, PROMPTS[0][p]].item()) < 1e-4
        assert [t["token_id"] for t in item["top_logprobs"]] == ref[p - 1].topk(2).indices.tolist()
