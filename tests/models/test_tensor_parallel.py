"""tp=2 (two gloo CPU processes) must give the logits of tp=1, from a checkpoint and from dummy weights."""
import json
from pathlib import Path

import torch

from spmd_engine.models.loader import load_dummy_weights, load_safetensors_weights
from spmd_engine.models.parallel import TensorParallel
from spmd_engine.models.registry import build_model
from tests.helpers.spawned_ranks import run_on_ranks
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint
from tests.models.hf_parity import PROMPTS, relative_error
from tests.models.paged_runner import run_paged

STEPS = 4
FORCED = [[11 * b + 3 * s + 4 for s in range(STEPS)] for b in range(len(PROMPTS))]


def run_scenarios(checkpoints: dict[str, Path], tp: TensorParallel) -> dict[str, list[torch.Tensor]]:
    """name -> [prefill logits, decode logits per step]; empty lists on ranks without logits."""
    results = {}
    for name, path in checkpoints.items():
        for source in ("safetensors", "dummy"):
            model = build_model(json.loads((path / "config.json").read_text()), tp)
            if source == "dummy":
                load_dummy_weights(model, seed=5)
            else:
                load_safetensors_weights(model, path)
            run = run_paged(model, PROMPTS, STEPS, forced_tokens=FORCED)
            results[f"{name}/{source}"] = ([torch.cat(run.prefill_logits)] if run.prefill_logits else []) + \
                run.decode_logits
    return results


def _worker(rank: int, checkpoints: dict[str, Path], out: Path) -> None:
    results = run_scenarios(checkpoints, TensorParallel.from_default_group())
    if rank == 0:
        torch.save(results, out)
    else:
        assert all(not logits for logits in results.values()), "logits must reach rank 0 only"


def test_two_ranks_match_one(tmp_path):
    checkpoints = {
        "qwen3-kv2": make_tiny_checkpoint(tmp_path / "q", arch="qwen3", num_kv_heads=2, vocab_size=301,
                                          tokenizer=False),
        "llama-kv1": make_tiny_checkpoint(tmp_path / "l", arch="llama", num_kv_heads=1, tie=True, attention_bias=True,
                                          mlp_bias=True, tokenizer=False),
    }
    out = tmp_path / "tp2.pt"
    run_on_ranks(_worker, (checkpoints, out))
    sharded = torch.load(out)
    single = run_scenarios(checkpoints, TensorParallel.single())
    assert sharded.keys() == single.keys()
    for name, ours in sharded.items():
        assert len(ours) == STEPS + 1
        for step, (a, b) in enumerate(zip(ours, single[name])):
            assert a.shape == b.shape and relative_error(a, b) < 1e-5, f"{name} step {step}"
