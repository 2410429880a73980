"""The job contract of run.py: composed config, Hydra multirun layout and metrics, reproducible seeded
sampling, and checkpoints that ship no tokenizer."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.e2e.engine_args import TOKEN_PROMPTS, tiny_args, write_prompts_file
from tests.helpers.run_engine import read_metrics, read_outputs, run_engine, run_engines, token_ids
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

SEEDED = {"temperature": 1.0, "top_p": 0.9, "seed": 7, "max_tokens": 12}
REQUESTS = [{"prompt": "hello"}, {"prompt_token_ids": TOKEN_PROMPTS[1], **SEEDED},
            {"prompt_token_ids": TOKEN_PROMPTS[1], **SEEDED, "seed": 8}]


def test_cfg_job_prints_the_composed_config(tmp_path: Path):
    run = run_engine(["--cfg", "job", "block_size=32", "sampling.top_k=5"], tmp_path, timeout_s=60).check()
    cfg = yaml.safe_load(run.stdout)
    assert cfg["block_size"] == 32 and cfg["sampling"]["top_k"] == 5
    assert cfg["model"]["name"] == "smollm2" and cfg["workload"]["name"] == "chat"
    assert not (tmp_path / "outputs").exists()  # printing the config runs no job


@pytest.fixture(scope="module")
def sweep(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`run.py -m block_size=16,32`: two jobs with the seeded requests; returns the sweep dir."""
    cwd = tmp_path_factory.mktemp("sweep")
    prompts = write_prompts_file(cwd / "requests.jsonl", REQUESTS)
    args = tiny_args(tiny_qwen3, None, prompts, **{"sampling.max_tokens": 6})
    run_engine(["-m", *args, "block_size=16,32", f"hydra.sweep.dir={cwd / 'sweep'}"], cwd, timeout_s=180).check()
    return cwd / "sweep"


def test_multirun_writes_outputs_and_metrics_per_job(sweep: Path):
    for job, block_size in (("0", 16), ("1", 32)):
        rows = read_outputs(sweep / job)
        assert [r["finish_reason"] for r in rows] == ["length"] * 3
        assert [len(r["token_ids"]) for r in rows] == [6, 12, 12]
        m = read_metrics(sweep / job)
        assert m["status"] == "ok" and m["config"]["block_size"] == block_size
        assert m["prompt_tokens"] == sum(len(r["prompt_token_ids"]) for r in rows)
        assert m["output_tokens"] == 30 and m["wall_time_s"] > 0
        assert m["output_tokens_per_s"] == pytest.approx(30 / m["wall_time_s"])
        assert m["ttft"]["count"] == 3 and 0 < m["ttft"]["p50_ms"] <= m["ttft"]["max_ms"]
        assert m["itl"]["count"] == 27 and m["itl"]["p99_ms"] >= m["itl"]["p50_ms"] > 0
        assert m["kv_capacity"]["blocks"] == 256 and m["kv_capacity"]["tokens"] == 256 * block_size
        assert m["kv_capacity"]["bytes"] > 0
    assert token_ids(sweep / "0") == token_ids(sweep / "1")  # block size changes no token, seeded or greedy


def test_seeded_sampling_reproducible_across_runs_and_no_tokenizer_checkpoint(sweep: Path, tiny_qwen3: Path,
                                                                              tmp_path: Path):
    bare = make_tiny_checkpoint(tmp_path / "no-tokenizer", arch="qwen3", tokenizer=False)
    assert not list(bare.glob("tokenizer*"))
    ids_only = write_prompts_file(tmp_path / "ids.jsonl", [{"prompt_token_ids": p} for p in TOKEN_PROMPTS[:2]]
                                  + [{"prompt": "text needs a tokenizer"}])
    again = write_prompts_file(tmp_path / "requests.jsonl", REQUESTS)
    run_engines([tiny_args(tiny_qwen3, tmp_path / "again", again, block_size=8, **{"sampling.max_tokens": 6}),
                 tiny_args(bare, tmp_path / "bare", ids_only, **{"sampling.max_tokens": 5})],
                tmp_path, timeout_s=180)[1].check()

    sampled = [r["token_ids"] for r in read_outputs(tmp_path / "again")]
    assert sampled == token_ids(sweep / "0")  # another process, another block size: the same samples
    assert sampled[1] != sampled[2]  # same prompt, another seed: the seed is what fixes the samples

    rows = read_outputs(tmp_path / "bare")
    assert [len(r["token_ids"]) for r in rows[:2]] == [5, 5]
    assert all(r["text"] is None and r["error"] is None and r["prompt"] is None for r in rows[:2])
    assert rows[2]["finish_reason"] == "error" and "prompt_token_ids" in rows[2]["error"]
