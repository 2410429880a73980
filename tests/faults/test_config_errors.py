"""Config errors seen by any rank (even one node only) end every rank before the weights load:
exit code 2 everywhere, one line on rank 0, no traceback anywhere."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.faults.launches import finish, start_plain, start_torchrun
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint


def copy_ckpt(src: Path, dst: Path, edit=None, drop: str | None = None) -> Path:
    shutil.copytree(src, dst)
    if drop:
        (dst / drop).unlink()
    if edit:
        config = json.loads((dst / "config.json").read_text())
        edit(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_config_errors_are_agreed_by_every_rank(fault_ckpt: Path, tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n")
    no_weights = copy_ckpt(fault_ckpt, tmp_path / "no-weights", drop="model.safetensors")
    mamba = copy_ckpt(fault_ckpt, tmp_path / "mamba", edit=lambda c: c.update(architectures=["MambaForCausalLM"]))
    three_heads = make_tiny_checkpoint(tmp_path / "three-heads", num_heads=3, num_kv_heads=1, tokenizer=False)
    per_rank = {0: {"SPMD_TEST_CKPT": str(fault_ckpt)}, 1: {"SPMD_TEST_CKPT": str(no_weights)}}
    cases = {  # name -> (overrides, per-rank env, words of rank 0's one line)
        "weights-missing-on-rank1": (["model.path=${oc.env:SPMD_TEST_CKPT}"], per_rank,
                                     ["[rank 1]", "no-weights", "no .safetensors files"]),
        "heads-not-divisible": ([f"model.path={three_heads}"], None,
                                ["tensor_parallel_size=2", "num_attention_heads=3"]),
        "unknown-architecture": ([f"model.path={mamba}"], None, ["MambaForCausalLM", "not supported"]),
        "pool-below-one-sequence": ([f"model.path={fault_ckpt}", "num_kv_blocks=2"], None,
                                    ["KV pool holds 2 blocks", "max_model_len=64"]),
        "prompts-file-missing": ([f"model.path={fault_ckpt}", f"prompts_file={tmp_path / 'nope.jsonl'}"], None,
                                 ["prompts_file=", "nope.jsonl", "no such file"]),
        "dp-times-tp-not-the-ranks": ([f"model.path={fault_ckpt}", "data_parallel_size=2", "tensor_parallel_size=2"],
                                      None, ["data_parallel_size=2 x tensor_parallel_size=2 = 4", "ranks (2)"]),
        "replica-tp-vs-heads": ([f"model.path={three_heads}", "data_parallel_size=1"], None,
                                ["tensor_parallel_size=2", "num_attention_heads=3"]),
        "symm-mem-all-reduce-on-cpu": ([f"model.path={fault_ckpt}", "tp_allreduce=symm_mem"], None,
                                       ["tp_allreduce=symm_mem is not available", "device is cpu"]),
    }
    launches = {}
    for name, (overrides, env, _) in cases.items():
        args = ["model=qwen3", f"prompts_file={prompts}", "device=cpu", "num_kv_blocks=64", "max_model_len=64",
                "dist_timeout_s=30", f"hydra.run.dir={tmp_path / name}", *overrides]
        launches[name] = start_plain(name, args, tmp_path, env_by_rank=env)
    finish(list(launches.values()), timeout_s=150)

    for name, (_, _, words) in cases.items():
        _one_line_on_rank0_before_the_weights(launches[name], name, words)


def _one_line_on_rank0_before_the_weights(launch, name: str, words: list[str]) -> str:
    """Both ranks exit 2, rank 0 says one line holding `words`, rank 1 nothing, no weights loaded."""
    rank0, rank1 = launch.procs
    assert launch.returncodes == [2, 2], launch.describe()
    lines = rank0.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and all(w in lines[0] for w in words), (name, lines)
    assert rank1.stderr.strip() == "" and "Traceback" not in rank0.stdout + rank1.stdout, launch.describe()
    assert "loaded" not in rank0.stdout, launch.describe()  # stopped before the weights
    return lines[0]


def test_bad_command_line_values_end_every_rank_before_the_weights(fault_ckpt: Path, tmp_path: Path):
    """Job-wide sampling defaults and unknown keys are config errors (exit 2 on every rank, one line,
    metrics status failed), not one failed row per request under status ok."""
    cases = {  # name -> (override, words of rank 0's one line)
        "max-tokens-0": ("sampling.max_tokens=0", ["sampling.max_tokens must be >= 1", "got 0"]),
        "max-tokens-abc": ("sampling.max_tokens=abc", ["sampling.max_tokens must be an integer", "'abc'"]),
        "temperature-abc": ("sampling.temperature=abc", ["sampling.temperature must be a number", "'abc'"]),
        "temperature-negative": ("sampling.temperature=-1", ["sampling.temperature must be >= 0"]),
        "unknown-key": ("+block_sise=16", ["unknown config key block_sise", "did you mean block_size?"]),
        "sampling-key-without-prefix": ("max_tokens=16", ["unknown config key max_tokens",
                                                          "did you mean sampling.max_tokens?"]),
    }
    launches = {}
    for name, (override, _) in cases.items():
        args = ["model=qwen3", f"model.path={fault_ckpt}", "device=cpu", "num_kv_blocks=64", "max_model_len=64",
                "dist_timeout_s=30", f"hydra.run.dir={tmp_path / name}", override]
        launches[name] = start_plain(name, args, tmp_path)
    finish(list(launches.values()), timeout_s=120)

    for name, (_, words) in cases.items():
        line = _one_line_on_rank0_before_the_weights(launches[name], name, words)
        assert "__init__" not in line and "keyword argument" not in line, line
        metrics = json.loads((tmp_path / name / "metrics.json").read_text())
        assert metrics["status"] == "failed" and all(w in metrics["error"] for w in words), metrics
        assert not (tmp_path / name / "outputs.jsonl").exists()


def test_under_torchrun_the_error_line_closes_the_output(fault_ckpt: Path, tmp_path: Path):
    """torchrun prints its ChildFailedError summary after everything the ranks printed; each rank's
    torchelastic error file makes the summary's last entry (the root cause's traceback, just above its
    closing border) the job's one error line, and every rank's exit code is the user-error 2."""
    args = ["model=qwen3", f"model.path={fault_ckpt}", "device=cpu", "num_kv_blocks=64", "max_model_len=64",
            f"hydra.run.dir={tmp_path / 'job'}", "sampling.top_p=1.5"]
    launch = start_torchrun("torchrun-config-error", args, tmp_path)
    finish([launch], timeout_s=120)
    proc = launch.procs[0]
    assert proc.returncode == 1, launch.describe()  # torchrun's own exit code for a failed launch
    line = "error: sampling.top_p must be in (0, 1], got 1.5"
    stderr_lines = [text.strip() for text in proc.stderr.splitlines() if text.strip()]
    assert stderr_lines.count(line) == 1, launch.describe()  # rank 0 said it once, before torchrun's summary
    # the last non-empty line that is not torchrun's closing border (only '=') holds the reason
    *_, last_words, border = stderr_lines
    assert set(border) == {"="} and last_words.endswith(line), launch.describe()
    assert "Root Cause" in proc.stderr and "To enable traceback" not in proc.stderr, launch.describe()
    assert proc.stderr.count("exitcode  : 2 ") == 2, launch.describe()  # both ranks exited 2, none SIGTERMed
    assert proc.stderr.count("Traceback (most recent call last)") == 1, launch.describe()  # torchrun's, no rank's
    metrics = json.loads((tmp_path / "job" / "metrics.json").read_text())
    assert metrics["status"] == "failed" and metrics["error"] in line, metrics
