"""Compare our model, loaded from an HF checkpoint, with transformers on the same checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from spmd_engine.models.loader import load_safetensors_weights
from spmd_engine.models.parallel import TensorParallel
from spmd_engine.models.registry import build_model
from tests.models.paged_runner import run_paged

NO_SCALING = None
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}
PROMPTS = [[5, 17, 33, 2, 250], [7] * 3 + list(range(40, 48)), list(range(100, 117))]  # 5, 11, 17 tokens
DECODE_STEPS = 16
TOLERANCE = 1e-4


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


def hf_logits(checkpoint: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Full-sequence (no cache) float32 logits from transformers, one [len, vocab] per sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return [model(torch.tensor([seq])).logits[0].float() for seq in sequences]


def assert_matches_hf(checkpoint: Path, config_override: dict | None = None) -> None:
    """Prefill of 3 prompts + 16 greedy decode steps: logits within TOLERANCE of transformers.

    `config_override` changes the config *our* model is built from (to show a mismatch is caught).
    """
    config = {**json.loads((checkpoint / "config.json").read_text()), **(config_override or {})}
    model = build_model(config, TensorParallel.single())
    load_safetensors_weights(model, checkpoint)
    run = run_paged(model, PROMPTS, DECODE_STEPS)
    refs = hf_logits(checkpoint, [p + g for p, g in zip(PROMPTS, run.generated)])

    prefill_ref = torch.cat([ref[: len(p)] for ref, p in zip(refs, PROMPTS)])
    prefill_err = relative_error(torch.cat(run.prefill_logits), prefill_ref)
    assert prefill_err < TOLERANCE, f"prefill relative error {prefill_err:.2e}"
    for step, ours in enumerate(run.decode_logits):
        ref = torch.stack([r[len(p) + step] for r, p in zip(refs, PROMPTS)])
        err = relative_error(ours, ref)
        assert err < TOLERANCE, f"decode step {step}: relative error {err:.2e}"
    assert len(set(map(tuple, run.generated))) > 1, "degenerate test: every prompt generated the same tokens"
