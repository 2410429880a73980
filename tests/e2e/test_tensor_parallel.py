"""SPMD tensor parallelism on CPU through torchrun: N ranks give exactly the tokens of one rank.

The prompts and budgets force prefix-cache hits, chunked prefill and recompute preemption in the
same run, so the plan broadcast, the block-table deltas and the TP forward are all exercised.
Only rank 0 may write: the other ranks leave no file behind. The single-rank references run
in-process from the very same arguments.

In bf16 too (default tp_reduce_dtype=float32): one rank's bf16 matmul accumulates in float32 and
rounds once, and so do the row-parallel sums over 2 ranks. That is exact up to float32 summation
order (not bitwise guaranteed: see docs/ARCHITECTURE.md), and it holds for these runs, while with
tp_reduce_dtype=model (each rank's partial rounded before the sum) the kv2 case's 2nd prompt
diverged at its 15th token (2026-11-30).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.e2e.engine_args import FRANCE, TOKEN_PROMPTS, tiny_args, write_prompts_file
from tests.helpers.run_engine import (REPO, EngineRun, generate_in_process, read_metrics, run_engine, run_engines,
                                      run_ranks, token_ids)
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

# 4-token blocks, 8-token steps and a 16-block pool for 5 sequences of up to 63 tokens
STRESS = {"block_size": 4, "max_num_batched_tokens": 8, "num_kv_blocks": 16, "max_model_len": 64}
JOB_FILES = {"outputs.jsonl", "metrics.json", "run.log", ".hydra"}
SMOLLM2_ARGS = [f"prompts={json.dumps([FRANCE, 'Name a colour.'])}", "sampling.temperature=0",
                "sampling.max_tokens=16", "sampling.ignore_eos=true", "cpu_kv_cache_gib=0.25", "max_model_len=256",
                "device=cpu"]


@pytest.fixture(scope="module")
def tiny_models(tiny_qwen3_ids: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """2 KV heads (split over 2 ranks) and 1 KV head (replicated on both ranks), 4 query heads each; no
    tokenizer (token-id prompts, no text checked): rank 0 does not import transformers."""
    kv1 = make_tiny_checkpoint(tmp_path_factory.mktemp("kv1") / "tiny-kv1", arch="qwen3", num_kv_heads=1,
                               max_position_embeddings=128, tokenizer=False)
    return {"kv2": tiny_qwen3_ids, "kv1": kv1}


# case -> (tiny model, extra keys)
TWO_RANK_CASES = {"kv2": ("kv2", {}), "kv1": ("kv1", {}), "kv2-bf16": ("kv2", {"dtype": "bfloat16"})}


@pytest.fixture(scope="module")
def two_rank_runs(tiny_models: dict[str, Path],
                  tmp_path_factory) -> tuple[Path, dict[str, tuple[EngineRun, list[str]]]]:
    """Every TWO_RANK_CASES case under STRESS on 2 ranks, the torchruns side by side in one cwd (with
    TMPDIR inside it) and job dirs job-<case>: (cwd, case -> (run, args))."""
    cwd = tmp_path_factory.mktemp("tp2")
    (cwd / "tmp").mkdir()
    prompts = write_prompts_file(cwd / "prompts.jsonl", [{"prompt_token_ids": p} for p in TOKEN_PROMPTS])
    args = {case: tiny_args(tiny_models[model], cwd / f"job-{case}", prompts, **STRESS, **keys)
            for case, (model, keys) in TWO_RANK_CASES.items()}
    runs = run_engines(list(args.values()), cwd, timeout_s=300, nproc=2, env={"TMPDIR": str(cwd / "tmp")})
    return cwd, {name: (run.check(), args[name]) for name, run in zip(args, runs)}


def _torchrun(args: list[str], cwd: Path, nproc: int) -> EngineRun:
    return run_engine(args, cwd, timeout_s=300, nproc=nproc, env={"TMPDIR": str(cwd / "tmp")}).check()


def step_counts(run: EngineRun) -> tuple[int, int, int]:
    """(steps, decode steps, preemptions) from rank 0's end-of-generate log line."""
    found = re.findall(r"generate: (\d+) steps \((\d+) decode\), (\d+) preemptions", run.stdout + run.stderr)
    assert len(found) == 1, run.describe()
    return tuple(map(int, found[0]))


def assert_only_rank0_wrote(cwd: Path, entries: set[str]) -> None:
    """cwd holds `entries` (inputs and rank 0's job dirs) and the TMPDIR, in which no rank left anything."""
    assert {p.name for p in cwd.iterdir()} == entries | {"tmp"}  # no outputs/ of any rank
    for job_dir in cwd.glob("job*"):
        assert {p.name for p in job_dir.iterdir()} == JOB_FILES
    leftovers = [p.name for p in (cwd / "tmp").iterdir() if not p.name.startswith("torchelastic_")]
    assert leftovers == []  # the other ranks' scratch Hydra dirs are gone (torchrun keeps its own)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TWO_RANK_CASES))
def test_two_ranks_match_one_rank_under_caching_chunking_and_preemption(case, two_rank_runs):
    cwd, runs = two_rank_runs
    run, args = runs[case]
    assert token_ids(cwd / f"job-{case}") == generate_in_process(args)
    steps, decode_steps, preemptions = step_counts(run)
    assert preemptions > 0
    assert steps - decode_steps >= sum(map(len, TOKEN_PROMPTS)) // STRESS["max_num_batched_tokens"]  # chunked
    metrics = read_metrics(cwd / f"job-{case}")
    assert metrics["world_size"] == 2 and metrics["cached_prompt_tokens"] > 0
    assert metrics["tp_allreduce"] == {"requested": "nccl", "path": "gloo", "reason": "tp_allreduce=nccl"}  # CPU: gloo
    assert_only_rank0_wrote(cwd, {"prompts.jsonl", *(f"job-{c}" for c in TWO_RANK_CASES)})


@pytest.mark.slow
def test_smollm2_three_ranks_match_one_rank(smollm2_dir: Path, tmp_path: Path):
    (tmp_path / "tmp").mkdir()
    run = _torchrun([*SMOLLM2_ARGS, f"hydra.run.dir={tmp_path / 'job'}"], tmp_path, nproc=3)
    expected = generate_in_process(SMOLLM2_ARGS)
    assert [len(t) for t in expected] == [16, 16]
    assert token_ids(tmp_path / "job") == expected
    assert read_metrics(tmp_path / "job")["world_size"] == 3 and "Paris" in run.stdout
    assert_only_rank0_wrote(tmp_path, {"job"})


@pytest.mark.slow
def test_smollm2_two_ranks_fail_on_divisibility_and_every_rank_exits(smollm2_dir: Path, tmp_path: Path):
    message = "error: tensor_parallel_size=2 must divide the model's num_attention_heads=9"
    args = [*SMOLLM2_ARGS, f"hydra.run.dir={tmp_path / 'job'}"]
    # torchrun: one line from the engine, non-zero exit
    run = run_engine(args, tmp_path, timeout_s=180, nproc=2)
    assert run.returncode != 0
    assert [line for line in run.stderr.splitlines() if line.startswith("error: ")] == [message], run.describe()
    assert f'File "{REPO}' not in run.stderr  # no traceback out of the engine (torchrun adds its own report)
    # the same ranks by hand, where each rank's own exit is visible: all agree, none is left waiting
    ranks = run_ranks(args, world_size=2, cwd=tmp_path, timeout_s=180)
    assert [r.returncode for r in ranks] == [2, 2], "\n".join(r.describe() for r in ranks)
    assert ranks[0].stderr.strip() == message and ranks[1].stderr.strip() == ""
    assert "Traceback" not in "".join(r.stdout + r.stderr for r in ranks)
