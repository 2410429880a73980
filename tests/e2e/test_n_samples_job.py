"""`n` in a job: one outputs.jsonl row per completion (index + sample_index, in order), `sampling.n` on the
command line and `"n"` on a line, an OpenAI batch response with n choices, and `resume=true` per completion."""
from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.engine_args import tiny_args, write_prompts_file
from tests.helpers.run_engine import read_outputs, run_engines

LINES = [
    {"prompt": "Once upon", "n": 3, "seed": 5, "temperature": 1.0},
    {"prompt_token_ids": [5, 6, 7, 8, 9]},  # sampling.n from the command line (2)
    {"custom_id": "c-1", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "Hello", "max_tokens": 4, "n": 2, "seed": 9, "temperature": 1.0}},
    {"prompt": "bad", "n": 0},
]


def test_n_rows_openai_choices_and_resume_per_completion(tiny_qwen3: Path, tmp_path: Path):
    prompts = write_prompts_file(tmp_path / "n.jsonl", LINES)
    rows_dir, openai_dir = tmp_path / "rows", tmp_path / "openai"
    common = {"sampling.n": 2, "sampling.max_tokens": 4}
    for run in run_engines([tiny_args(tiny_qwen3, rows_dir, prompts, **common),
                            tiny_args(tiny_qwen3, openai_dir, prompts, output_format="openai", **common)],
                           tmp_path, 300):
        run.check()
    rows = read_outputs(rows_dir)
    assert [(r["index"], r.get("sample_index")) for r in rows] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, None)]
    assert rows[-1]["finish_reason"] == "error" and "sampling.n must be" in rows[-1]["error"]
    assert len({tuple(r["token_ids"]) for r in rows[:3]}) > 1  # seeds 5, 6, 7 draw different completions
    assert rows[3]["token_ids"] == rows[4]["token_ids"]  # greedy children are identical
    assert all(r["sampling"]["n"] == (3 if r["index"] == 0 else 2) for r in rows[:-1])
    metrics = json.loads((rows_dir / "metrics.json").read_text())
    assert metrics["num_requests"] == 4 and metrics["num_completions"] == 8

    objects = [json.loads(line) for line in (openai_dir / "outputs.jsonl").read_text().splitlines()]
    assert len(objects) == 4
    body = objects[2]["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1] and objects[2]["custom_id"] == "c-1"
    assert [c["text"] for c in body["choices"]] == [r["text"] for r in rows[5:7]]
    assert body["usage"]["completion_tokens"] == sum(len(r["token_ids"]) for r in rows[5:7])

    # a crash that lost completion 1 of request 0 and all of request 2: resume runs just those
    kept = [r for r in rows if (r["index"], r.get("sample_index")) not in {(0, 1), (2, 0), (2, 1)}]
    (rows_dir / "outputs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    [run] = run_engines([tiny_args(tiny_qwen3, rows_dir, prompts, resume="true", **common)], tmp_path, 300)
    run.check()
    assert read_outputs(rows_dir) == rows
