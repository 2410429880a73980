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


# Under pytest-xdist (`-n 2 --dist loadgroup`, pyproject's addopts) every module runs on one worker, so a
# module's fixtures start once. Modules that start rank processes (a job, torchrun, spawned ranks) share one
# group: one such launch runs at a time, beside one in-process test, so the fault tests' stop times hold on
# a 2-core machine.
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
