"""The checkpoint's generation_config.json sets the job's sampling defaults, under the command line
and a prompts-file line's own keys."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from spmd_engine.job.generation_defaults import explicit_sampling_keys
from tests.e2e.engine_args import write_prompts_file
from tests.helpers.run_engine import read_outputs, run_engines


def test_explicit_sampling_keys():
    assert explicit_sampling_keys(["sampling.top_k=5", "+sampling.seed=1", "device=cpu", "model.path=x"]) == {
        "top_k", "seed"}


def _args(ckpt: Path, job_dir: Path, prompts: Path, *extra: str) -> list[str]:
    return [f"model.path={ckpt}", f"prompts_file={prompts}", "device=cpu", "dtype=float32", "num_kv_blocks=64",
            "sampling.max_tokens=3", "sampling.ignore_eos=true", f"hydra.run.dir={job_dir}", *extra]


def test_generation_config_defaults_applied_and_overridden(tiny_qwen3: Path, tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen3, ckpt)
    gen = json.loads((ckpt / "generation_config.json").read_text())
    gen.update(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.1, do_sample=True)
    (ckpt / "generation_config.json").write_text(json.dumps(gen))
    prompts = write_prompts_file(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b", "top_k": 5}])
    runs = run_engines([_args(ckpt, tmp_path / "auto", prompts),
                        _args(ckpt, tmp_path / "cli", prompts, "sampling.temperature=0")], tmp_path, 300)
    for run in runs:
        run.check()
    auto, line = read_outputs(tmp_path / "auto")
    assert (auto["sampling"]["temperature"], auto["sampling"]["top_p"], auto["sampling"]["top_k"]) == (0.7, 0.8, 20)
    assert line["sampling"]["top_k"] == 5 and line["sampling"]["temperature"] == 0.7
    cli, _ = read_outputs(tmp_path / "cli")
    assert (cli["sampling"]["temperature"], cli["sampling"]["top_p"], cli["sampling"]["top_k"]) == (0.0, 0.8, 20)
    logged = runs[0].stdout + runs[0].stderr
    assert "sampling defaults from" in logged and "temperature=0.7" in logged
    assert auto["sampling"]["repetition_penalty"] == 1.1 and "repetition_penalty=1.1" in logged
    assert "command line keeps temperature" in runs[1].stdout + runs[1].stderr
