"""One rank of a torchrun launch that updates the weights in place (tests/spmd_engine/test_update_weights.py):
every rank builds the same tensor-parallel LLM from checkpoint A, generates, takes checkpoint B's tensors,
generates again, then tries a bad name; OUT_DIR/rank<r>.json holds what it saw."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13]}, {"prompt_token_ids": [40, 41, 42, 43, 44]}]


def main(first: str, second: str, out_dir: str) -> None:
    llm = LLM(model=first, device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64, max_num_seqs=4,
              tensor_parallel_size=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]
    llm.update_weights(load_file(Path(second) / "model.safetensors").items())
    after = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]
    try:
        llm.update_weights([("model.layers.0.mlp.up_proj.weight_x", torch.zeros(128, 64))])
        error = None
    except ConfigError as exc:
        error = str(exc)
    llm.close()
    rank = int(os.environ["RANK"])
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"before": before, "after": after, "error": error}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
