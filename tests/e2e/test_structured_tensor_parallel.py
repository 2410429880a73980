"""Structured outputs over several ranks: grammars live on each replica's rank 0 only (it alone samples), so 2
tensor-parallel ranks, and 2 data-parallel replicas, under KV pressure and chunked prefill give the one-rank job's
constrained tokens, row for row."""
from __future__ import annotations

import json
import re

import pytest

from tests.e2e.engine_args import tiny_args, write_prompts_file
from tests.helpers.run_engine import read_outputs, run_engine
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

REGEX = r"[a-c]{2,4}-\d{2}"
CHOICES = ["red", "green", "blue"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
LINES = [
    {"prompt": "pick one: ", "structured_outputs": {"choice": CHOICES}, "seed": 1},
    {"prompt": "code " * 6, "structured_outputs": {"regex": REGEX}, "seed": 2},
    {"prompt": "json please ", "structured_outputs": {"json": SCHEMA}, "seed": 3},
    {"prompt": "free text " * 3, "seed": 4},  # unconstrained beside the others
]
# 4-token blocks, 8-token steps, a 24-block pool: chunked prefill and preemption in one run
KEYS = {"block_size": 4, "max_num_batched_tokens": 8, "num_kv_blocks": 24, "max_model_len": 96,
        "sampling.temperature": 0.9, "sampling.max_tokens": 24, "sampling.ignore_eos": "false"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("structured_tp")
    ckpt = make_tiny_checkpoint(root / "ckpt", num_kv_heads=2, max_position_embeddings=128)
    prompts = write_prompts_file(root / "prompts.jsonl", LINES)
    rows = {}
    for name, nproc, more in (("one", None, {}), ("tp2", 2, {}), ("dp2", 2, {"data_parallel_size": 2})):
        run_engine(tiny_args(ckpt, root / name, prompts, **KEYS, **more), root, timeout_s=300, nproc=nproc).check()
        rows[name] = read_outputs(root / name)
    return rows


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_two_ranks_give_the_one_rank_constrained_rows(runs, layout):
    one, two = runs["one"], runs[layout]
    assert [r["token_ids"] for r in two] == [r["token_ids"] for r in one]
    assert [r["text"] for r in two] == [r["text"] for r in one]
    choice, regex, schema, _ = one
    assert all(r["error"] is None for r in one), one
    assert choice["text"] in CHOICES and choice["finish_reason"] == "stop"
    assert regex["finish_reason"] == "stop" and re.fullmatch(REGEX, regex["text"]), regex
    assert schema["finish_reason"] == "stop" and 0 <= json.loads(schema["text"])["n"] <= 9, schema
