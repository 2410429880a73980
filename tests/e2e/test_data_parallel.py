"""Data-parallel replicas on CPU (gloo): every dp x tp layout gives one process's greedy tokens, in one
outputs.jsonl in submission order, with the requests handed out as the replicas ask for them.

One sequence at a time per replica (max_num_seqs=1): a replica claims one request at a time and every
replica gets work. Token-id jobs that check no text run a checkpoint without a tokenizer (every replica's
leader would otherwise import transformers); the resume test keeps it, its rows' text is compared.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.engine_args import TOKEN_PROMPTS, tiny_args, write_prompts_file
from tests.helpers.run_engine import generate_in_process, read_metrics, read_outputs, run_engine, token_ids

PROMPTS = [{"prompt_token_ids": p} for p in TOKEN_PROMPTS * 3]  # 15 requests


def _run(args: list[str], cwd: Path, nproc: int) -> None:
    (cwd / "tmp").mkdir(exist_ok=True)
    run_engine(args, cwd, timeout_s=300, nproc=nproc, env={"TMPDIR": str(cwd / "tmp")}).check()


def _replica_requests(job_dir: Path) -> list[int]:
    metrics = read_metrics(job_dir)
    assert metrics["num_requests"] == sum(r["requests"] for r in metrics["replicas"])
    return [r["requests"] for r in metrics["replicas"]]


@pytest.mark.slow
@pytest.mark.parametrize("nproc,keys", [(2, {"data_parallel_size": 2}), (3, {"data_parallel_size": 3}),
                                        (4, {"data_parallel_size": 2, "tensor_parallel_size": 2})],
                         ids=["dp2", "dp3", "dp2xtp2"])
def test_replicas_give_the_one_process_tokens_in_one_outputs_file(tiny_qwen3_ids: Path, tmp_path: Path, nproc, keys):
    prompts = write_prompts_file(tmp_path / "prompts.jsonl", PROMPTS)
    args = tiny_args(tiny_qwen3_ids, tmp_path / "job", prompts, max_num_seqs=1, **{"sampling.max_tokens": 24})
    _run([*args, *(f"{k}={v}" for k, v in keys.items())], tmp_path, nproc)
    assert token_ids(tmp_path / "job") == generate_in_process(args)  # read_outputs: one row per index, in order
    counts = _replica_requests(tmp_path / "job")
    assert len(counts) == keys["data_parallel_size"] and sum(counts) == len(PROMPTS)
    assert min(counts) > 0, counts  # every replica took work
    metrics = read_metrics(tmp_path / "job")
    assert (metrics["data_parallel_size"], metrics["tensor_parallel_size"]) == (keys["data_parallel_size"],
                                                                               nproc // keys["data_parallel_size"])
    assert {p.name for p in tmp_path.iterdir()} == {"prompts.jsonl", "job", "tmp"}  # only rank 0 wrote


@pytest.mark.slow
def test_a_replica_given_a_long_request_takes_fewer_requests(tiny_qwen3_ids: Path, tmp_path: Path):
    """Request 0 generates 120 tokens, the 15 others 1 each, one sequence per replica at a time: the
    replica that drew request 0 must not get half of the job (a split up front gives 8 and 8)."""
    rows = [{"prompt_token_ids": [5, 6, 7], "max_tokens": 120}] + [{"prompt_token_ids": [9, i], "max_tokens": 1}
                                                                   for i in range(15)]
    prompts = write_prompts_file(tmp_path / "prompts.jsonl", rows)
    args = tiny_args(tiny_qwen3_ids, tmp_path / "job", prompts, max_num_seqs=1, data_parallel_size=2)
    _run(args, tmp_path, nproc=2)
    outputs = read_outputs(tmp_path / "job")
    assert [len(r["token_ids"]) for r in outputs] == [120] + [1] * 15
    counts = _replica_requests(tmp_path / "job")
    assert min(counts) <= 4, counts
    busy = [r["busy_s"] for r in read_metrics(tmp_path / "job")["replicas"]]
    assert all(b > 0 for b in busy), busy


@pytest.mark.slow
def test_resume_across_replicas_runs_only_the_missing_requests(tiny_qwen3: Path, tmp_path: Path):
    prompts = write_prompts_file(tmp_path / "prompts.jsonl", PROMPTS)
    args = tiny_args(tiny_qwen3, tmp_path / "job", prompts, max_num_seqs=2, data_parallel_size=2,
                     **{"sampling.max_tokens": 8})
    _run(args, tmp_path, nproc=2)
    full = read_outputs(tmp_path / "job")
    kept = [full[i] for i in (0, 3, 4, 9)]  # as a crash would leave them: out of order, and a torn line
    (tmp_path / "job" / "outputs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"index": 1, "tok')
    _run([*args, "resume=true"], tmp_path, nproc=2)
    assert read_outputs(tmp_path / "job") == full
    assert read_metrics(tmp_path / "job")["num_requests"] == len(PROMPTS) - len(kept)


@pytest.mark.slow
def test_smollm2_three_replicas_match_one_process(smollm2_dir: Path, tmp_path: Path):
    questions = ["What is the capital of France? Answer in one sentence.", "Name a colour.", "Count to five.",
                 "Say hello."]
    args = [f"prompts={json.dumps(questions)}", "sampling.temperature=0", "sampling.max_tokens=12",
            "sampling.ignore_eos=true", "cpu_kv_cache_gib=0.25", "max_model_len=256", "device=cpu", "max_num_seqs=1",
            f"hydra.run.dir={tmp_path / 'job'}"]
    _run([*args, "data_parallel_size=3"], tmp_path, nproc=3)
    assert token_ids(tmp_path / "job") == generate_in_process(args)
    counts = _replica_requests(tmp_path / "job")
    assert len(counts) == 3 and sum(counts) == len(questions)



@pytest.mark.slow
def test_two_replicas_metrics_total_every_replica(tiny_qwen3_ids: Path, tmp_path: Path):
    """metrics.json of a dp=2 bench job describes the whole job, not replica 0: engine steps summed over
    the replicas (each one's kept), requests / tokens / busy time totalled as outputs.jsonl has them, and
    the bench's tok/s is every output token over the wall time, per GPU that over the 2 ranks."""
    prompts = write_prompts_file(tmp_path / "prompts.jsonl", PROMPTS[:1])  # unread: the bench makes its own
    bench = ["workload=bench", "workload.num_seqs=10", "workload.min_input_len=4", "workload.max_input_len=24",
             "workload.min_output_len=3", "workload.max_output_len=6", "workload.token_id_max=290",
             "workload.warmup=false"]
    args = tiny_args(tiny_qwen3_ids, tmp_path / "job", prompts, max_num_seqs=1, data_parallel_size=2)
    _run([*args, *bench], tmp_path, nproc=2)
    rows = read_outputs(tmp_path / "job")
    metrics = read_metrics(tmp_path / "job")
    output_tokens = sum(len(r["token_ids"]) for r in rows)
    assert len(rows) == metrics["num_requests"] == 10 and metrics["output_tokens"] == output_tokens
    assert all(r["error"] is None for r in rows), rows
    replicas = metrics["replicas"]
    assert [r["replica"] for r in replicas] == [0, 1] and min(r["requests"] for r in replicas) > 0, replicas
    assert sum(r["output_tokens"] for r in replicas) == output_tokens
    assert metrics["busy_s"] == pytest.approx(sum(r["busy_s"] for r in replicas)) and metrics["busy_s"] > 0
    engine = metrics["engine"]
    per_replica = engine["per_replica"]
    assert [r["replica"] for r in per_replica] == [0, 1]
    for key in ("steps", "decode_steps", "preemptions", "cached_prompt_tokens"):
        assert engine[key] == sum(r[key] for r in per_replica), key
    assert [r["steps"] for r in replicas] == [r["steps"] for r in per_replica]
    # one sequence at a time per replica: every output token took a step of its replica
    for row, run in zip(replicas, per_replica):
        assert run["steps"] >= row["output_tokens"] > 0, (row, run)
    assert engine["steps"] >= output_tokens
    assert engine["step_timing"]["steps"] == engine["steps"]
    assert engine["step_timing"]["all"]["steps"] == engine["steps"]
    assert all(run["kv_capacity"]["blocks"] == metrics["kv_capacity"]["blocks"] for run in per_replica)
    report = metrics["bench"]
    assert report["world_size"] == 2 and report["steps"] == engine["steps"]
    assert report["output_tokens_per_s"] == pytest.approx(output_tokens / metrics["wall_time_s"])
    assert report["output_tokens_per_s"] == pytest.approx(metrics["output_tokens_per_s"])
    assert report["output_tokens_per_s_per_gpu"] == pytest.approx(report["output_tokens_per_s"] / 2)
    assert metrics["output_tokens_per_s_per_gpu"] == pytest.approx(metrics["output_tokens_per_s"] / 2)
    assert [r["replica"] for r in report["per_replica"]] == [0, 1]
    assert report["min_decode_steps"] == max(len(r["token_ids"]) for r in rows) - 1
