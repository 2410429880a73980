"""Bad input at job level: a bad request fails alone with one line; a bad engine key fails the job fast.

A batch job must never be sunk by one bad line, and a config mistake must cost one clear line on
stderr and exit code 2, not a traceback after the weights have loaded.
"""
from __future__ import annotations

import json
import shutil
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
        # the reader's errors and the engine's (length, vocabulary, sampling) alike name the line
        assert row["error"].startswith(f"prompts_file line {row['index'] + 1}: "), row["error"]
    metrics = read_metrics(job_dir)
    assert metrics["status"] == "ok" and metrics["num_errors"] == len(BAD_REQUESTS)


def test_bad_engine_config_exits_2_with_one_line_before_loading(tiny_qwen3: Path, tmp_path: Path):
    prompts = write_prompts_file(tmp_path / "requests.jsonl", GOOD_REQUESTS)
    cases = {  # override -> words the one stderr line must contain
        "block_size=24": ["block_size", "power of two", "24"],
        "gpu_memory_utilization=1.5": ["gpu_memory_utilization", "(0, 1]", "1.5"],
        "num_kv_blocks=3": ["num_kv_blocks", "max_model_len=128", "3 blocks"],
        f"model.path={tmp_path / 'no-such-checkpoint'}": ["model.path", "no-such-checkpoint"],
        f"model.path={_escaping_checkpoint(tiny_qwen3, tmp_path)}": [
            "model.safetensors.index.json", "'../outside.safetensors'", "not a file inside the checkpoint dir"],
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


def _escaping_checkpoint(ckpt: Path, tmp_path: Path) -> Path:
    """A copy of `ckpt` whose shard index names a file outside its dir (`../`): it used to be read."""
    escaping = tmp_path / "escaping"
    shutil.copytree(ckpt, escaping)
    (escaping / "model.safetensors").rename(tmp_path / "outside.safetensors")
    (escaping / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    return escaping


HUGE_PROMPT = "z" * 300_000
HOSTILE = [  # (raw line, words its one-line error must contain): no line may end the job or grow its row
    (b'{"prompt":"caf\xe9"}', ["not UTF-8"]),  # latin-1 bytes
    (b"[" * 100_000 + b"]" * 100_000, ["nested too deeply"]),
    (b'{"prompt":"a \\ud800"}', ["not valid Unicode", "U+D800"]),  # a lone surrogate
    (b'{"prompt_token_ids":[' + b"7" * 5000 + b"]}", ["4300 digits"]),
    (b'{"prompt":"hi","temperature":NaN}', ["temperature", "must be a number"]),
    (b'{"prompt":"hi","top_p":Infinity}', ["top_p", "(0, 1]"]),
    (b'{"prompt":"hi","max_tokens":1e999}', ["max_tokens", "integer"]),
    (b'{"prompt_token_ids":[5, 99999999999999999999999]}', ["outside the vocabulary"]),
    (b'{"prompt":["not", "a", "string"]}', ["must be a string"]),
    (b'[{"prompt":"in an array"}]', ["expected a JSON object"]),
    (b'{"prompt":"a\x00b"}', ["invalid JSON"]),  # a raw NUL byte
    (json.dumps({"prompt": HUGE_PROMPT}).encode(), ["max_model_len=32"]),
]
GOOD_LINES = [b'{"prompt": "hi"}\r', b'{"prompt": "a\xc2\x85b\xe2\x80\xa8"}',
              b'{"prompt_token_ids": [40, 41, 42, 43], "max_tokens": 3}']


def test_a_file_of_hostile_lines_fails_only_those_requests(tiny_qwen3: Path, tmp_path: Path):
    lines = [GOOD_LINES[0], b"", *[line for line, _ in HOSTILE[:6]], GOOD_LINES[1], b"  ",
             *[line for line, _ in HOSTILE[6:]], GOOD_LINES[2]]
    prompts = tmp_path / "hostile.jsonl"
    prompts.write_bytes(b"\n".join(lines) + b"\n")
    job_dir = tmp_path / "job"
    run_engine(tiny_args(tiny_qwen3, job_dir, prompts, max_model_len=MAX_MODEL_LEN, **{"sampling.max_tokens": 4}),
               tmp_path, timeout_s=120).check()

    out = read_outputs(job_dir)
    assert len(out) == len(lines)  # line N is row N - 1: a blank line is an error row, nothing shifts
    blank = [row for row in out if row["error"] is not None and "the line is blank" in row["error"]]
    assert [row["index"] for row in blank] == [1, 9]
    assert all(row["error"].startswith(f"prompts_file line {row['index'] + 1}: ") for row in out if row["error"])
    out = [row for row in out if row not in blank]
    good = [row for row in out if row["error"] is None]
    assert [row["index"] for row in good] == [0, 8, len(lines) - 1]
    assert [(row["finish_reason"], len(row["token_ids"])) for row in good] == [("length", 4), ("length", 4),
                                                                              ("length", 3)]
    assert good[1]["prompt"] == "a\x85b\u2028"  # NEL and LINE SEPARATOR: one line (JSON strings may hold them)
    bad = [row for row in out if row["error"] is not None]
    for row, (_, words) in zip(bad, HOSTILE):
        assert row["finish_reason"] == "error" and row["token_ids"] == [], row
        assert "\n" not in row["error"] and all(w in row["error"] for w in words), (row["error"], words)
    huge = bad[-1]  # echoes 200 characters with the full length; more than 32 tokens can hold: never tokenized
    assert huge["prompt"] == HUGE_PROMPT[:200] and huge["prompt_chars"] == len(HUGE_PROMPT)
    assert huge["prompt_token_ids"] is None and "characters" in huge["error"] and "not tokenized" in huge["error"]
    assert (job_dir / "outputs.jsonl").stat().st_size < 20_000
    metrics = read_metrics(job_dir)
    assert metrics["status"] == "ok" and metrics["num_errors"] == len(HOSTILE) + len(blank)
