"""Bad input at job level: a bad request fails alone with one line; a bad engine key fails the job fast.

A batch job must never be sunk by one bad line, and a config mistake must cost one clear line on
stderr and exit code 2, not a traceback after the weights have loaded.
"""
from __future__ import annotations

from pathlib import Path

from tests.e2e.engine_args import tiny_args, write_prompts_file
from tests.helpers.run_engine import read_metrics, read_outputs, run_engine, run_engines

MAX_MODEL_LEN = 32
BAD_REQUESTS = [  # (request line, words its one-line error must contain)
    ({"prompt_token_ids": list(range(3, 3 + MAX_MODEL_LEN + 5))}, ["max_model_len=32"]),
    ({"prompt": ""}, ["empty"]),
    ({"prompt_token_ids": [5, 6, 300]}, ["prompt_token_ids[2]=300", "vocabulary"]),
    ({"prompt": "hi", "max_tokens": 0}, ["max_tokens", ">= 1"]),
    ({"prompt": "hi", "temperature": -1}, ["temperature", ">= 0"]),
    ({"prompt": "hi", "top_p": 1.5}, ["top_p", "(0, 1]"]),
    ({"prompt": "hi", "top_k": -2}, ["top_k", "-1"]),
    ('{"prompt": "unterminated', ["invalid JSON"]),
]
GOOD_REQUESTS = [{"prompt": "hi"}, {"prompt_token_ids": [40, 41, 42, 43], "max_tokens": 3}]


def test_each_bad_request_fails_alone_with_one_line(tiny_qwen3: Path, tmp_path: Path):
    rows = [GOOD_REQUESTS[0], *[line for line, _ in BAD_REQUESTS], GOOD_REQUESTS[1]]
    prompts = write_prompts_file(tmp_path / "requests.jsonl", rows)
    job_dir = tmp_path / "job"
    run_engine(tiny_args(tiny_qwen3, job_dir, prompts, max_model_len=MAX_MODEL_LEN, **{"sampling.max_tokens": 4}),
               tmp_path, timeout_s=120).check()

    out = read_outputs(job_dir)
    assert len(out) == len(rows)
    good, bad = [out[0], out[-1]], out[1:-1]
    assert [r["finish_reason"] for r in good] == ["length", "length"]
    assert [len(r["token_ids"]) for r in good] == [4, 3] and all(r["error"] is None for r in good)
    assert good[0]["text"] is not None
    for row, (_, words) in zip(bad, BAD_REQUESTS):
        assert row["finish_reason"] == "error" and row["token_ids"] == [], row
        assert "\n" not in row["error"] and all(w in row["error"] for w in words), (row["error"], words)
    metrics = read_metrics(job_dir)
    assert metrics["status"] == "ok" and metrics["num_errors"] == len(BAD_REQUESTS)


def test_bad_engine_config_exits_2_with_one_line_before_loading(tiny_qwen3: Path, tmp_path: Path):
    prompts = write_prompts_file(tmp_path / "requests.jsonl", GOOD_REQUESTS)
    cases = {  # override -> words the one stderr line must contain
        "block_size=24": ["block_size", "power of two", "24"],
        "gpu_memory_utilization=1.5": ["gpu_memory_utilization", "(0, 1]", "1.5"],
        "num_kv_blocks=3": ["num_kv_blocks", "max_model_len=128", "3 blocks"],
        f"model.path={tmp_path / 'no-such-checkpoint'}": ["model.path", "no-such-checkpoint"],
    }
    runs = run_engines([tiny_args(tiny_qwen3, tmp_path / f"job{i}", prompts) + [case]
                        for i, case in enumerate(cases)], tmp_path, timeout_s=120)
    for (case, words), run in zip(cases.items(), runs):
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2, (case, run.describe())
        assert len(lines) == 1 and lines[0].startswith("error: "), (case, run.stderr)
        assert all(w in lines[0] for w in words), (case, lines[0])
        assert "Traceback" not in run.stdout + run.stderr
        assert " loaded (" not in run.stdout  # failed before the weights were read
