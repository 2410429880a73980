"""The run dir holds finished work: no second writer, no rerun that drops rows, no traceback (or hang)
when it can't be written — one line and exit 2 on every rank instead."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spmd_engine.config import ConfigError
from spmd_engine.job.run_dir import LOCK_NAME, check_rerun, claim_run_dir, lock_run_dir
from tests.helpers.run_engine import REPO, run_engines, run_ranks

PROMPTS = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}, {"prompt_token_ids": [10, 11, 12, 13]}]


def _args(ckpt: Path, job_dir: Path, prompts: Path, *extra: str) -> list[str]:
    return ["model=qwen3", f"model.path={ckpt}", f"prompts_file={prompts}", "device=cpu", "dtype=float32",
            "sampling.temperature=0", "sampling.max_tokens=3", "sampling.ignore_eos=true", "num_kv_blocks=64",
            "dist_timeout_s=60", f"hydra.run.dir={job_dir}", *extra]


def _prompts(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def finished_job(fault_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A job dir whose outputs.jsonl holds PROMPTS' 3 finished rows, and its prompts file (copy before use)."""
    cwd = tmp_path_factory.mktemp("finished")
    prompts = _prompts(cwd / "p.jsonl", PROMPTS)
    run_engines([_args(fault_ckpt, cwd / "job", prompts)], cwd, timeout_s=120)[0].check()
    return cwd / "job", prompts


def _copy(job: Path, to: Path) -> tuple[Path, bytes]:
    shutil.copytree(job, to)
    return to, (to / "outputs.jsonl").read_bytes()


def _files(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (relative path -> bytes): what a refused job must leave as it was."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _one_error_line(run, *words: str) -> None:
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2, run.describe()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
    assert all(w in lines[0] for w in words), (lines[0], words)
    assert "Traceback" not in run.stdout + run.stderr


def test_one_writer_per_run_dir(tmp_path: Path):
    first = lock_run_dir(tmp_path)
    assert (tmp_path / LOCK_NAME).read_text().startswith("pid ")
    with pytest.raises(ConfigError, match=r"is in use by another job \(pid \d+ on .*\); one job writes a run dir"):
        lock_run_dir(tmp_path)
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()  # a finished run dir holds only its outputs
    lock_run_dir(tmp_path).release()
    # another process holds it: the same refusal (flock is per open file, held until that process ends)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from spmd_engine.job.run_dir import lock_run_dir; "
                               "held = lock_run_dir(Path(sys.argv[1])); "
                               "print('locked', flush=True); time.sleep(60)", str(tmp_path)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=f"pid {holder.pid} on"):
            lock_run_dir(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    lock_run_dir(tmp_path).release()  # the OS dropped the dead holder's lock


def test_rerun_without_resume_never_drops_finished_rows(tmp_path: Path):
    check_rerun(tmp_path, resume=False)  # nothing there yet
    (tmp_path / "outputs.jsonl").write_text('{"index": 0, "token_ids": [1]}\n{"index": 1, "tok')  # one + torn
    with pytest.raises(ConfigError, match="already holds 1 finished rows in outputs.jsonl; pass resume=true"):
        check_rerun(tmp_path, resume=False)
    check_rerun(tmp_path, resume=True)
    with pytest.raises(ConfigError):
        claim_run_dir(tmp_path, resume=False)
    assert not (tmp_path / LOCK_NAME).exists()  # a refused claim leaves no lock behind
    (tmp_path / "outputs.jsonl").write_text('{"index": 1, "tok')  # only a torn line: nothing finished
    claim_run_dir(tmp_path, resume=False).release()


def test_rerun_second_writer_and_unwritable_dir_end_the_job_with_one_line(fault_ckpt: Path, tmp_path: Path,
                                                                          finished_job: tuple[Path, Path]):
    job, finished = _copy(finished_job[0], tmp_path / "job")
    prompts = finished_job[1]
    assert len(finished.splitlines()) == 3 and not (job / LOCK_NAME).exists()
    before = _files(job)
    assert {"outputs.jsonl", "metrics.json", ".hydra/config.yaml"} <= set(before)
    busy = tmp_path / "busy"
    held = lock_run_dir(busy)  # a job still writing there
    (tmp_path / "a-file").write_text("x")
    try:
        rerun, second, unwritable, sweep = run_engines([
            _args(fault_ckpt, job, prompts),
            _args(fault_ckpt, busy, prompts),
            _args(fault_ckpt, tmp_path / "a-file" / "job", prompts),
            ["-m", *_args(fault_ckpt, job, prompts)[:-1], "block_size=16,32",
             f"hydra.sweep.dir={tmp_path / 'a-file' / 'sweep'}"]], tmp_path, timeout_s=120)
    finally:
        held.release()
    _one_error_line(rerun, "already holds 3 finished rows", "resume=true", "another hydra.run.dir")
    assert _files(job) == before  # untouched: outputs, metrics, Hydra's config and log
    _one_error_line(second, "is in use by another job", f"pid {os.getpid()}")
    assert _files(busy) == {}  # (the lock file was removed on release)
    _one_error_line(unwritable, "hydra.run.dir=", "a-file/job", "is not writable (Not a directory)")
    # a sweep: each point fails with the line (and the sweep goes on), no Hydra traceback
    assert sweep.stderr.count("error: hydra.sweep.dir=") == 2 and "is not writable" in sweep.stderr, sweep.describe()
    assert "Traceback" not in sweep.stdout + sweep.stderr
    for run in (rerun, second, unwritable, sweep):
        assert " loaded (" not in run.stdout  # refused before the weights were read


def test_unwritable_run_dir_ends_every_rank_of_a_plain_launch(fault_ckpt: Path, tmp_path: Path):
    """Rank 0's Hydra used to die in a traceback before the rendezvous, the other rank waited for it."""
    prompts = _prompts(tmp_path / "p.jsonl", PROMPTS)
    (tmp_path / "a-file").write_text("x")
    rank0, rank1 = run_ranks(_args(fault_ckpt, tmp_path / "a-file" / "job", prompts), 2, tmp_path, timeout_s=90)
    _one_error_line(rank0, "is not writable")
    assert rank1.returncode == 2 and "Traceback" not in rank1.stderr, rank1.describe()


def test_resume_with_another_prompts_file_is_refused_on_every_rank(fault_ckpt: Path, tmp_path: Path,
                                                                   finished_job: tuple[Path, Path]):
    job, finished = _copy(finished_job[0], tmp_path / "job")
    prompts = finished_job[1]
    changed = _prompts(tmp_path / "changed.jsonl", [PROMPTS[0], {"prompt_token_ids": [8, 9, 1]}, *PROMPTS[2:]])
    rank0, rank1 = run_ranks(_args(fault_ckpt, job, changed, "resume=true"), 2, tmp_path, timeout_s=120)
    _one_error_line(rank0, "resume=true: outputs.jsonl row 1 is not this job's request 1",
                    "prompt_token_ids differ: kept [8, 9], now [8, 9, 1]")
    assert rank1.returncode == 2 and "Traceback" not in rank1.stderr, rank1.describe()
    assert (job / "outputs.jsonl").read_bytes() == finished
    assert (job / "metrics.json").read_bytes() == (finished_job[0] / "metrics.json").read_bytes()
    same, _ = _copy(finished_job[0], tmp_path / "same")
    hotter, again = run_engines([_args(fault_ckpt, job, prompts, "resume=true", "sampling.temperature=0.5"),
                                 _args(fault_ckpt, same, prompts, "resume=true")], tmp_path, timeout_s=120)
    _one_error_line(hotter, "row 0 is not this job's request 0: sampling.temperature differs: kept 0.0, now 0.5")
    again.check()
    assert "3 requests already in" in again.stdout + again.stderr  # the same prompts and sampling: accepted
    assert (job / "outputs.jsonl").read_bytes() == (same / "outputs.jsonl").read_bytes() == finished
