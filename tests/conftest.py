import os
import re
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU, must precede @triton.jit


import pytest

_REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded SmolLM2-135M-Instruct as a HF directory, converted once into the shared cache."""
    from spmd_engine.models.gguf import embedded_model_dir

    return embedded_model_dir()


# With pytest-xdist installed (the test extra), the suite runs in two workers unless `-n` says otherwise
# (`-n 0`: one process, needed for `-s` output). Every module runs on one worker, so its fixtures start once;
# modules that start rank processes (a job, torchrun, spawned ranks) share one group: one such launch runs at
# a time, beside one in-process test, so the fault tests' stop times hold on a 2-core machine.
WORKERS = 2


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    if not config.pluginmanager.hasplugin("xdist") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if config.option.numprocesses is None and not config.getoption("usepdb", False):
        config.option.numprocesses = WORKERS
    if config.option.numprocesses and config.option.dist == "no":
        config.option.dist = "loadgroup"


_RANK_DIRS = ("tests/faults/", "tests/e2e/", "tests/launch/", "tests/gpu/")
_RANK_SOURCES = re.compile(r"run_engine|spawned_ranks|api_ranks|update_ranks|torchrun|engine_runs")


def _xdist_group(path: Path) -> str:
    rel = path.relative_to(_REPO).as_posix()
    if rel.startswith(_RANK_DIRS) or _RANK_SOURCES.search(path.read_text()):
        return "ranks"
    return rel


def pytest_collection_modifyitems(config, items):
    groups: dict[Path, str] = {}
    for item in items:
        path = Path(str(item.fspath))
        if path not in groups:
            groups[path] = _xdist_group(path)
        item.add_marker(pytest.mark.xdist_group(groups[path]))


if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # two workers share the two cores; a rank process sets its own threads
