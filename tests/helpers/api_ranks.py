"""Ranks of a torchrun launch of the public API: every rank builds the same LLMs, makes the same calls and
writes what it got back under OUT_DIR (tests/spmd_engine/test_api.py).

`tp`: the default layout (one replica over the ranks), the LLM that makes the process group, written to
rank<r>.json. `dp` / `dp_tp`: data_parallel_size=2 (with the rest of the ranks tensor parallel), the
replica calls (`replica_calls`), written to rank<r>-<layout>.json. Several layouts share one launch: the
first LLM stays open while the next runs in its group, so a layout costs no second start of the ranks.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from spmd_engine import LLM, SamplingParams

TINY_KEYS = {"device": "cpu", "block_size": 4, "num_kv_blocks": 64, "max_model_len": 64}
REPLICA_KEYS = {**TINY_KEYS, "max_num_seqs": 1}  # one request at a time per replica: every replica claims some
REPLICA_PROMPTS = ["hello", {"prompt_token_ids": [5, 6, 7, 8]}, "the cat", {"prompt_token_ids": [9, 10]},
                   "abc", {"prompt_token_ids": [40, 41, 42]}, "xy", {"prompt_token_ids": []}]
CONVERSATIONS = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "two"}]]


def replica_params() -> list[SamplingParams]:
    """Greedy and seeded requests alternating, of different lengths."""
    return [SamplingParams(temperature=0.0, max_tokens=3 + i, ignore_eos=True) if i % 2 == 0 else
            SamplingParams(temperature=0.8, top_p=0.95, max_tokens=3 + i, seed=10 + i, ignore_eos=True)
            for i in range(len(REPLICA_PROMPTS))]


def replica_calls(llm: LLM) -> dict:
    """What a layout with replicas is asked (and the one-process reference, in the test)."""
    outs = llm.generate(REPLICA_PROMPTS, replica_params())
    counts = list(llm.requests_per_replica)
    chats = llm.chat(CONVERSATIONS, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    return {"generate": [dataclasses.asdict(o) for o in outs], "requests_per_replica": counts,
            "chat": [dataclasses.asdict(o) for o in chats]}


def _tp_call(llm: LLM) -> list[dict]:
    outs = llm.generate(["hello", {"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": []}],
                        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6, seed=3))
    return [dataclasses.asdict(o) for o in outs]


LAYOUTS = {"tp": ({}, _tp_call), "dp": ({"data_parallel_size": 2}, replica_calls),
           "dp_tp": ({"data_parallel_size": 2, "tensor_parallel_size": 2}, replica_calls)}


def main(checkpoint: str, out_dir: str, *layouts: str) -> None:
    rank = int(os.environ["RANK"])
    opened = []
    try:
        for name in layouts:
            keys, call = LAYOUTS[name]
            llm = LLM(model=checkpoint, **(TINY_KEYS if name == "tp" else REPLICA_KEYS), **keys)
            opened.append(llm)
            got = call(llm)
            Path(out_dir, f"rank{rank}.json" if name == "tp" else f"rank{rank}-{name}.json").write_text(json.dumps(got))
    finally:
        for llm in reversed(opened):  # the first one made the process group: it goes last
            llm.close()


if __name__ == "__main__":
    main(*sys.argv[1:3], *(sys.argv[3:] or ["tp"]))
