"""Qwen3-0.6B's real shape with dummy weights runs sampled requests to completion on one GPU."""
from pathlib import Path

import torch
import yaml

from spmd_engine.config import engine_config_from_dict
from spmd_engine.engine import Engine
from spmd_engine.job.prompts import PromptRequest
from tests.gpu.engine_setup import GPU, SINGLE, engine_overrides

pytestmark = GPU
QWEN3 = Path(__file__).resolve().parents[2] / "conf" / "model" / "qwen3.yaml"


def test_dummy_qwen3_runs_to_completion():
    model = yaml.safe_load(QWEN3.read_text())
    model["load_format"] = "dummy"
    raw = {"model": model, "workload": {"name": "chat"},
           "sampling": {"temperature": 0.6, "top_p": 0.95, "max_tokens": 24, "ignore_eos": True},
           **engine_overrides(num_kv_blocks=None, max_num_seqs=16, max_model_len=1024, gpu_memory_utilization=0.5)}
    llm = Engine(engine_config_from_dict(raw), SINGLE)
    try:
        assert llm.runner.graphs is not None and llm.runner.num_blocks * 16 >= 1024
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 10000, (n,), generator=gen).tolist() for n in (7, 300, 1000 - 24, 64, 65)]
        outs = llm.generate([PromptRequest(i, None, p) for i, p in enumerate(prompts)])
        assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
        assert all(len(o.token_ids) == 24 and max(o.token_ids) < 151936 for o in outs)
        assert llm.runner.graphs.num_replays >= 20
    finally:
        llm.close()
