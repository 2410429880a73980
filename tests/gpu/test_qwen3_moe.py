"""Qwen3-MoE on one GPU: a tiny float32 checkpoint through the Triton kernels and CUDA graphs gives HF's greedy
tokens; the Qwen3-30B-A3B shape (dummy weights, fewer layers) runs to completion without compiling a fused MoE
kernel after start-up."""
from pathlib import Path

import pytest
import torch
import yaml

from spmd_engine.config import engine_config_from_dict
from spmd_engine.engine import Engine
from spmd_engine.job.prompts import PromptRequest
from tests.gpu.engine_setup import GPU, SINGLE, engine_overrides, make_llm
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint
from tests.spmd_engine.test_engine import PROMPTS, hf_greedy

pytestmark = GPU
QWEN3_MOE = Path(__file__).resolve().parents[2] / "conf" / "model" / "qwen3_moe.yaml"


def test_tiny_float32_moe_matches_hf_with_graphs(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "ckpt", arch="qwen3_moe", hidden_size=128, num_heads=2, num_kv_heads=1,
                                head_dim=64, max_position_embeddings=256, tokenizer=False,
                                moe=dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64))
    expected = hf_greedy(path, PROMPTS, 16)
    llm = make_llm(path, dtype="float32")
    try:
        outs = llm.generate([PromptRequest(i, None, p) for i, p in enumerate(PROMPTS)])
        assert [o.token_ids for o in outs] == expected
        assert llm.runner.graphs is not None and llm.runner.graphs.num_replays > 0
    finally:
        llm.close()


def _compiled_kernels() -> int:
    """Compiled variants of the fused MoE kernels in this process (Triton's per-device caches)."""
    from spmd_engine.kernels import fused_moe

    total = 0
    for fn in (fused_moe._gate_up_kernel, fused_moe._down_kernel):
        if not hasattr(fn, "device_caches"):
            pytest.skip("this Triton keeps no device_caches to count compiled kernels in")
        for cache in fn.device_caches.values():
            total += len(cache[0])
    return total


def test_qwen3_30b_a3b_shape_runs_without_compiling_mid_job():
    model = yaml.safe_load(QWEN3_MOE.read_text())
    model["load_format"] = "dummy"
    model["hf_config"]["num_hidden_layers"] = 6
    raw = {"model": model, "workload": {"name": "chat"},
           "sampling": {"temperature": 0.6, "top_p": 0.95, "max_tokens": 24, "ignore_eos": True},
           **engine_overrides(num_kv_blocks=None, max_num_seqs=64, max_model_len=2048, gpu_memory_utilization=0.5,
                              max_num_batched_tokens=4096)}
    llm = Engine(engine_config_from_dict(raw), SINGLE)
    try:
        compiled = _compiled_kernels()
        assert compiled > 0
        gen = torch.Generator().manual_seed(0)
        lengths = (1, 7, 300, 2000, 64, 65, 1500, 33) + (20,) * 40
        prompts = [torch.randint(0, 150000, (n,), generator=gen).tolist() for n in lengths]
        outs = llm.generate([PromptRequest(i, None, p) for i, p in enumerate(prompts)])
        assert all(o.finish_reason == "length" and len(o.token_ids) == 24 for o in outs)
        assert _compiled_kernels() == compiled, "a fused MoE kernel was compiled after start-up"
    finally:
        llm.close()
