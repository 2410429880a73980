"""One rank of a torchrun launch of the public API: every rank builds the same LLM, makes the same
generate call and writes what it got back to OUT_DIR/rank<r>.json (tests/spmd_engine/test_api.py)."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from spmd_engine import LLM, SamplingParams


def main(checkpoint: str, out_dir: str) -> None:
    llm = LLM(model=checkpoint, device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64)
    outs = llm.generate(["hello", {"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": []}],
                        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6, seed=3))
    llm.close()
    rank = int(os.environ["RANK"])
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps([dataclasses.asdict(o) for o in outs]))


if __name__ == "__main__":
    main(*sys.argv[1:3])
