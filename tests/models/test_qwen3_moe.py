"""Qwen3-MoE against transformers (logits, fp32), its weight mapping, its errors, and 2 / 4 tensor-parallel
ranks (gloo CPU) against one rank for both expert splits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spmd_engine.models.loader import load_dummy_weights, load_safetensors_weights
from spmd_engine.models.model_config import ModelShape
from spmd_engine.models.parallel import TensorParallel
from spmd_engine.models.qwen3_moe import Qwen3MoeSparseBlock
from spmd_engine.models.registry import build_model
from tests.helpers.spawned_ranks import run_on_ranks
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint
from tests.models.hf_parity import PROMPTS, assert_matches_hf, relative_error
from tests.models.paged_runner import run_paged

CASES = {
    "e8-k2-norm": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "e4-k1-nonorm": dict(num_experts=4, num_experts_per_tok=1, norm_topk_prob=False),
    "e6-k3-nonorm-mlp-only-0": dict(num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[0]),
    "e16-k4-norm-step2": dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=2,
                              moe_intermediate_size=16),
}


@pytest.mark.parametrize("moe", CASES.values(), ids=CASES.keys())
def test_qwen3_moe_logits_match_transformers(tmp_path, moe):
    assert_matches_hf(make_tiny_checkpoint(tmp_path, arch="qwen3_moe", tokenizer=False, moe=moe))


def test_dense_and_sparse_layers_follow_the_config(tmp_path):
    path = make_tiny_checkpoint(tmp_path, arch="qwen3_moe", tokenizer=False, num_layers=3,
                                moe=dict(mlp_only_layers=[0], decoder_sparse_step=1))
    model = build_model(json.loads((path / "config.json").read_text()), TensorParallel.single())
    kinds = [isinstance(layer.mlp, Qwen3MoeSparseBlock) for layer in model.model.layers]
    assert kinds == [False, True, True]
    assert tuple(model.model.layers[1].mlp.experts.w13.shape) == (8, 64, 64)  # E, 2 x 32, hidden
    assert tuple(model.model.layers[1].mlp.experts.w2.shape) == (8, 64, 32)


def moe_config(**overrides) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 300, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 30,
            **overrides}


@pytest.mark.parametrize("config,tp,message", [
    (moe_config(), 4, "must divide the model's num_experts=6 with moe_tp_split=experts"),
    (moe_config(moe_tp_split="intermediate"), 4, "must divide the model's moe_intermediate_size=30"),
    (moe_config(moe_tp_split="rows"), 1, "moe_tp_split must be one of experts|intermediate"),
    (moe_config(num_experts_per_tok=7), 1, r"num_experts_per_tok must be in \[1, num_experts=6\]"),
])
def test_bad_moe_shapes_fail_with_one_line(config, tp, message):
    with pytest.raises(ValueError, match=message):
        ModelShape.from_hf_config(config).validate_tensor_parallel(tp)


def test_num_local_experts_is_read_as_num_experts():
    config = moe_config()
    config["num_local_experts"] = config.pop("num_experts")
    assert ModelShape.from_hf_config(config).moe.num_experts == 6


STEPS = 3
FORCED = [[11 * b + 3 * s + 4 for s in range(STEPS)] for b in range(len(PROMPTS))]


def run_splits(path: Path, tp: TensorParallel) -> dict[str, list[torch.Tensor]]:
    """split/source -> [prefill logits, decode logits per step]; empty lists on ranks without logits."""
    config = json.loads((path / "config.json").read_text())
    results = {}
    for split, source in (("experts", "safetensors"), ("intermediate", "safetensors"), ("experts", "dummy")):
        model = build_model(config, tp, moe_tp_split=split)
        if source == "dummy":
            load_dummy_weights(model, seed=3)
        else:
            load_safetensors_weights(model, path)
        run = run_paged(model, PROMPTS, STEPS, forced_tokens=FORCED)
        results[f"{split}/{source}"] = ([torch.cat(run.prefill_logits)] if run.prefill_logits else []) + \
            run.decode_logits
    return results


def _worker(rank: int, path: Path, out: Path) -> None:
    results = run_splits(path, TensorParallel.from_default_group())
    if rank == 0:
        torch.save(results, out)


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_ranks_match_one_rank(tmp_path, world_size):
    path = make_tiny_checkpoint(tmp_path / "ckpt", arch="qwen3_moe", tokenizer=False,
                                moe=dict(num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1]))
    out = tmp_path / "tp.pt"
    run_on_ranks(_worker, (path, out), world_size=world_size)
    sharded, single = torch.load(out), run_splits(path, TensorParallel.single())
    assert sharded.keys() == single.keys()
    for name, ours in sharded.items():
        assert len(ours) == STEPS + 1
        for step, (a, b) in enumerate(zip(ours, single[name])):
            assert a.shape == b.shape and relative_error(a, b) < 1e-5, f"{name} step {step}"


def test_bench_floor_counts_the_experts_a_step_touches():
    from types import SimpleNamespace

    from spmd_engine.job.bench_report import bench_work

    shape = ModelShape.from_hf_config(moe_config(num_experts=8, moe_intermediate_size=32))
    model = build_model(moe_config(num_experts=8, moe_intermediate_size=32), TensorParallel.single())
    llm = SimpleNamespace(shape=shape, replica=SimpleNamespace(tp_size=1), model=model, dtype=torch.float32,
                          runner=SimpleNamespace(spec=SimpleNamespace(bytes_per_block=64)),
                          cfg=SimpleNamespace(block_size=4))
    outputs = [SimpleNamespace(prompt_token_ids=[1, 2], token_ids=[5] * n, finish_reason="length", sample_index=0)
               for n in (3, 5)]
    work = bench_work(llm, outputs)
    expert = 3 * 64 * 32 * 4  # gate, up, down of hidden 64 x 32 in float32
    touched = lambda batch: 8 * (1 - (1 - 2 / 8) ** batch) * expert  # noqa: E731
    # decode steps 0..3: both sequences for 2 steps, then the longer one alone; 2 sparse layers
    assert work["expert_bytes_read"] == pytest.approx(2 * (2 * touched(2) + 2 * touched(1)))
    assert work["batch1_expert_bytes"] == pytest.approx(2 * 2 * expert)  # k = 2 experts per layer
    assert work["min_decode_steps"] == 4


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # triton interpreter noise
@pytest.mark.parametrize("split", ["experts", "intermediate"])
def test_the_kernel_path_of_a_loaded_block_matches_its_reference_path(tmp_path, monkeypatch, split):
    """The layer as the GPU runs it (Triton route + fused experts, interpreted on CPU) on a rank's loaded shard:
    the stacked weights are laid out as the kernels read them. 3 tokens: the GEMV-style path; 20: grouped."""
    from spmd_engine.models.loader import WeightTarget, load_into, stream_safetensors

    path = make_tiny_checkpoint(tmp_path, arch="qwen3_moe", tokenizer=False, num_layers=1,
                                moe=dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False))
    config = json.loads((path / "config.json").read_text())
    model = build_model(config, TensorParallel.single())  # its checkpoint name -> parameter mapping
    # rank 1's shard of a 2-rank group (this process reaches no collective: all_reduce patched out)
    block = Qwen3MoeSparseBlock(ModelShape.from_hf_config({**config, "moe_tp_split": split}),
                                TensorParallel(rank=1, world_size=2))
    params = dict(block.named_parameters())
    for name, tensor in stream_safetensors([path / "model.safetensors"]):
        if name.startswith("model.layers.0.mlp."):
            target, shard = model.checkpoint_to_parameter(name)
            load_into(WeightTarget(name, params[target.removeprefix("model.layers.0.mlp.")], shard), tensor)
    monkeypatch.setattr(TensorParallel, "all_reduce", lambda self, x: x)
    for tokens in (3, 20):
        hidden = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
        reference = block(hidden)
        with monkeypatch.context() as patch:
            patch.setattr(Qwen3MoeSparseBlock, "use_kernels", lambda self, x: True)
            kernels = block(hidden)
        assert reference.abs().max() > 0
        torch.testing.assert_close(kernels, reference, atol=1e-5, rtol=1e-5)


CONF = Path(__file__).resolve().parents[2] / "conf" / "model"


@pytest.mark.parametrize("group,total_b,active_b", [("qwen3_moe", 30.5, 3.3), ("qwen3_moe_235b", 235.1, 22.2)])
def test_config_groups_have_the_published_sizes_and_split_over_8_ranks(group, total_b, active_b):
    import yaml

    config = yaml.safe_load((CONF / f"{group}.yaml").read_text())["hf_config"]
    with torch.device("meta"):
        model = build_model(config, TensorParallel.single())
    total = sum(p.numel() for p in model.parameters())
    moe = model.shape.moe
    expert = 3 * model.shape.hidden_size * moe.intermediate_size
    active = total - model.shape.num_layers * (moe.num_experts - moe.top_k) * expert  # as published: embedding in
    assert total / 1e9 == pytest.approx(total_b, rel=0.01)
    assert active / 1e9 == pytest.approx(active_b, rel=0.05)
    for split in ("experts", "intermediate"):
        for tp in (2, 4, 8):
            ModelShape.from_hf_config({**config, "moe_tp_split": split}).validate_tensor_parallel(tp)
