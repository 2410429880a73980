"""Structured outputs on the GPU: the bitmask kernel against its reference at Qwen3's vocabulary (logits a view
of a wider buffer, as the LM head's), and constrained requests giving the same tokens with CUDA graphs and
sampler graphs (the mask applied to a decode graph's static logits) as eagerly, every output valid.

    python -m pytest -q tests/gpu/test_structured_outputs_gpu.py
"""
import json
import re

import pytest
import torch

from spmd_engine import LLM, SamplingParams
from spmd_engine.kernels.reference import apply_token_bitmask_reference
from spmd_engine.kernels.token_bitmask import apply_token_bitmask
from tests.gpu.engine_setup import GPU
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

pytestmark = GPU


@pytest.mark.parametrize("vocab", [151936, 49152, 1000])
def test_kernel_is_the_reference_on_cuda(vocab):
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    logits = torch.randn(64, vocab + 64, generator=gen)[:, :vocab]
    mask = torch.randint(-2**31, 2**31 - 1, (40, words), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = torch.randperm(64, generator=gen)[:40]
    expected = apply_token_bitmask_reference(logits.clone(), mask, rows)
    got = logits.cuda()
    apply_token_bitmask(got, mask.cuda(), rows.cuda())
    assert torch.equal(got.cpu(), expected)


def test_graphs_and_eager_give_the_same_constrained_tokens(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", arch="qwen3", vocab_size=512, hidden_size=256, num_heads=4,
                                num_kv_heads=2, head_dim=64, intermediate_size=512, num_layers=2,
                                max_position_embeddings=512, init_std=0.05, dtype=torch.bfloat16)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"enum": ["x", "y"]}}, "required": ["a", "b"]}
    forms = [{"json": schema}, {"regex": r"[a-f]{3}-\d{2}"}, {"choice": ["red", "green"]}, {"json_object": True}]
    # plain temperature rows only (top_p 1): a uniform decode batch, drawn by a sampler-graph replay
    params = [SamplingParams(temperature=0.8, top_p=1.0, seed=i, max_tokens=48, structured_outputs=forms[i % 4])
              for i in range(16)]
    prompts = [f"request {i}" for i in range(len(params))]
    results = []
    for keys in ({}, {"enforce_eager": True}):
        llm = LLM(model=str(ckpt), device="cuda", max_model_len=256, num_kv_blocks=256, **keys)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            results.append(([o.outputs[0].token_ids for o in outs], llm.engine.last_run["sampler_graph_steps"]))
        finally:
            llm.close()
    (graphs, graph_steps), (eager, _) = results
    assert graph_steps > 0 and graphs == eager
    for out, p in zip(outs, params):
        done, so = out.outputs[0], p.structured_outputs
        if done.finish_reason != "stop":
            continue
        if "json" in so:
            assert set(json.loads(done.text)) == {"a", "b"}
        elif "regex" in so:
            assert re.fullmatch(so["regex"], done.text)
        elif "choice" in so:
            assert done.text in so["choice"]
