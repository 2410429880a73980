"""Every command in the README's ```bash blocks, run as a user would on CPU (or skipped, with the reason).

Why: a documented command that exits 0 with every request failing is a broken promise that no other
test notices. `COMMANDS` lists each README command with how it runs here (arguments appended to keep
it small on 2 cores: fewer tokens, a tiny shape for the dummy Qwen3); the first test fails when the
README and this list disagree, so a new command cannot go untested by accident.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.engine_args import REAL_PROMPT_ARGS
from tests.helpers.run_engine import REPO, EngineRun, read_metrics, read_outputs, run_engine

README = REPO / "README.md"
FEW_TOKENS = ["sampling.max_tokens=2"]
# the dummy Qwen3 at its real 0.6B shape takes minutes on a shared 2-core CPU; the same command at a
# tiny shape runs the same code path (dummy weights, no tokenizer, tensor parallel) in seconds
TINY_QWEN3 = ["model.hf_config.num_hidden_layers=2", "model.hf_config.hidden_size=64",
              "model.hf_config.intermediate_size=128", "model.hf_config.num_attention_heads=4",
              "model.hf_config.num_key_value_heads=2", "model.hf_config.head_dim=16",
              "model.hf_config.vocab_size=1024", "max_model_len=256", "num_kv_blocks=64"]
TINY_MOE = [*TINY_QWEN3, "model.hf_config.moe_intermediate_size=32", "model.hf_config.num_experts=8",
            "model.hf_config.num_experts_per_tok=2"]
TINY_BENCH = ["workload.num_seqs=3", "workload.min_input_len=4", "workload.max_input_len=24",
              "workload.min_output_len=2", "workload.max_output_len=4", "workload.token_id_max=1000"]
PLACEHOLDER_CKPT = "/ckpt/Qwen3-0.6B"


@dataclass
class Run:
    """How one README command runs here: `extra` appended, `files` written into its working directory
    first, `check` called with (the run, its working directory); `fixture`: a session fixture that already
    runs this very command (a (run, job dir) pair), checked instead of running it twice."""

    check: Callable[[EngineRun, Path], None]
    extra: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    fixture: str | None = None


@dataclass
class Skip:
    reason: str


@dataclass
class Report:
    """The sweep report over a multirun that the README's multirun command makes (run first, small)."""

    sweep: list[str]


def only_job_dir(cwd: Path) -> Path:
    """`cwd` if it is a job dir, else the one job dir Hydra made under it (outputs/DATE/TIME)."""
    if (cwd / "metrics.json").is_file():
        return cwd
    dirs = [p.parent for p in cwd.glob("outputs/*/*/metrics.json")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def completed(count: int, text: bool = True) -> Callable[[EngineRun, Path], None]:
    """The job wrote `count` rows, none failed, each with generated tokens (and text: a tokenizer)."""

    def check(run: EngineRun, cwd: Path) -> None:
        job_dir = only_job_dir(cwd)
        rows = read_outputs(job_dir)
        assert len(rows) == count and all(r["error"] is None and r["token_ids"] for r in rows), run.describe()
        assert all((r["text"] is not None) == text for r in rows), rows
        assert read_metrics(job_dir)["status"] == "ok", run.describe()

    return check


def token_prompts_on_two_ranks(run: EngineRun, cwd: Path) -> None:
    completed(4, text=False)(run, cwd)
    assert "no tokenizer" in run.stdout and "token-id prompts" in run.stdout, run.describe()
    assert read_metrics(only_job_dir(cwd))["world_size"] == 2


def two_replicas(run: EngineRun, cwd: Path) -> None:
    completed(4, text=False)(run, cwd)
    metrics = read_metrics(only_job_dir(cwd))
    assert metrics["data_parallel_size"] == 2 and [r["replica"] for r in metrics["replicas"]] == [0, 1]


def bench_ran(run: EngineRun, cwd: Path) -> None:
    completed(3, text=False)(run, cwd)
    assert "bench" in read_metrics(only_job_dir(cwd)), run.describe()


def printed_config(run: EngineRun, cwd: Path) -> None:
    assert "block_size: 16" in run.stdout and "sampling:" in run.stdout, run.describe()
    assert not (cwd / "outputs").exists()  # printing the config runs no job


def one_job_per_value(run: EngineRun, cwd: Path) -> None:
    jobs = sorted(cwd.glob("multirun/*/*/*/metrics.json"))
    assert len(jobs) == 2, run.describe()
    blocks = sorted(read_metrics(p.parent)["config"]["block_size"] for p in jobs)
    assert blocks == [16, 32] and all(read_metrics(p.parent)["status"] == "ok" for p in jobs), run.describe()


REQUESTS_JSONL = json.dumps({"prompt": "Name a color."}) + "\n" + json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n"
COMMANDS: dict[str, Run | Skip | Report] = {
    "bash launch/setup.sh": Skip("installs the packages; CI (.ci/run) runs it before pytest"),
    "python run.py": Run(completed(4), FEW_TOKENS),
    "python -m pytest -q": Skip("the test suite itself"),
    'python run.py prompts=["What is the capital of France? Answer in one sentence."] sampling.temperature=0 '
    "sampling.max_tokens=32": Run(completed(1), fixture="smollm2_single"),  # REAL_PROMPT_ARGS
    "python run.py prompts_file=requests.jsonl": Run(completed(2), FEW_TOKENS, {"requests.jsonl": REQUESTS_JSONL}),
    f"python run.py model=qwen3 model.path={PLACEHOLDER_CKPT}": Run(completed(4), [*FEW_TOKENS, "num_kv_blocks=64"]),
    "python run.py model=qwen3 model.load_format=dummy workload=bench": Run(bench_ran, [*TINY_QWEN3, *TINY_BENCH]),
    "python run.py model=qwen3_moe model.load_format=dummy workload=bench": Run(bench_ran, [*TINY_MOE, *TINY_BENCH]),
    "torchrun --nproc_per_node=2 run.py model=qwen3 model.load_format=dummy":
        Run(token_prompts_on_two_ranks, [*TINY_QWEN3, *FEW_TOKENS]),
    "torchrun --nproc_per_node=2 run.py model=qwen3 model.load_format=dummy data_parallel_size=2":
        Run(two_replicas, [*TINY_QWEN3, *FEW_TOKENS]),
    "python run.py --cfg job": Run(printed_config),
    "python run.py -m block_size=16,32": Run(one_job_per_value, FEW_TOKENS),
    "python launch/sweep_report.py multirun/DATE/TIME": Report(["-m", "block_size=16,32", *FEW_TOKENS]),
}


def readme_commands() -> list[list[str]]:
    """The commands of the README's ```bash blocks as argument lists: comments dropped, `a && b` is two."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", README.read_text(), re.S | re.M):
        for line in block.splitlines():
            command: list[str] = []
            for token in [*shlex.split(line, comments=True), "&&"]:
                if token != "&&":
                    command.append(token)
                elif command:
                    commands.append(command)
                    command = []
    return commands


def test_every_readme_command_is_listed_here():
    assert sorted(" ".join(c) for c in readme_commands()) == sorted(COMMANDS)


def run_args(command: list[str], ckpt: Path) -> tuple[list[str], int | None]:
    """The run.py arguments of a README command and its rank count (None: plain python); the placeholder
    checkpoint path becomes a tiny real checkpoint (with a tokenizer)."""
    args = [f"model.path={ckpt}" if a == f"model.path={PLACEHOLDER_CKPT}" else a for a in command]
    if command[:2] == ["python", "run.py"]:
        return args[2:], None
    nproc = re.fullmatch(r"--nproc_per_node=(\d+)", command[1]) if command[0] == "torchrun" else None
    assert nproc and command[2] == "run.py", command  # torchrun runs with --standalone here (a free port)
    return args[3:], int(nproc.group(1))


@pytest.mark.slow  # ~1 minute in all: the real SmolLM2 four times, a 2-rank torchrun, a multirun
@pytest.mark.parametrize("command", readme_commands(), ids=lambda c: " ".join(c)[:60])
def test_readme_command(command: list[str], tiny_qwen3: Path, tmp_path: Path, request: pytest.FixtureRequest):
    how = COMMANDS[" ".join(command)]
    if isinstance(how, Skip):
        pytest.skip(how.reason)
    if isinstance(how, Report):
        sweep = run_engine(how.sweep, tmp_path, timeout_s=300)
        assert sweep.returncode == 0, sweep.describe()
        (sweep_dir,) = {p.parent.parent for p in tmp_path.glob("multirun/*/*/*/metrics.json")}
        report = subprocess.run([sys.executable, str(REPO / command[1]), str(sweep_dir)], capture_output=True,
                                text=True, timeout=120, cwd=tmp_path)
        assert report.returncode == 0, report.stderr
        assert "block_size" in report.stdout and "ok" in report.stdout, report.stdout
        assert (sweep_dir / "sweep.png").is_file(), report.stdout
        return
    if how.fixture is not None:
        assert run_args(command, tiny_qwen3) == (REAL_PROMPT_ARGS, None)
        how.check(*request.getfixturevalue(how.fixture))
        return
    for name, text in how.files.items():
        (tmp_path / name).write_text(text)
    args, nproc = run_args(command, tiny_qwen3)
    run = run_engine([*args, *how.extra], tmp_path, timeout_s=300, nproc=nproc)
    assert run.returncode == 0, run.describe()
    how.check(run, tmp_path)
