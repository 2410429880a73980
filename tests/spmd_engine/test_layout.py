"""The package layout's rules, checked on the source: which package may import which, no import
cycles, and every package folder installed under the spmd_engine namespace."""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# package -> the spmd_engine packages it must never import (docs/ARCHITECTURE.md, "Packages")
FORBIDDEN = {
    "spmd_engine.core": ("spmd_engine.executor", "spmd_engine.job", "spmd_engine.engine", "spmd_engine.api",
                         "spmd_engine.step_loop", "spmd_engine.llm", "spmd_engine.tokenizer",
                         "spmd_engine.faults", "spmd_engine.telemetry", "spmd_engine.models", "spmd_engine.kernels"),
    "spmd_engine.executor": ("spmd_engine.job", "spmd_engine.engine", "spmd_engine.step_loop", "spmd_engine.llm",
                             "spmd_engine.api"),
    "spmd_engine.engine": ("spmd_engine.job", "spmd_engine.llm", "spmd_engine.api"),
    # rank 0's loop: below the engine that starts it, above the scheduler and the executor it drives
    "spmd_engine.step_loop": ("spmd_engine.job", "spmd_engine.engine", "spmd_engine.llm", "spmd_engine.api"),
    "spmd_engine.llm": ("spmd_engine.job",),  # the public API stands without the Hydra job
    # what the API shares with the job (the replicas' hand-out, the checkpoint's sampling defaults) stands below both
    "spmd_engine.replica_dispatch": ("spmd_engine.job", "spmd_engine.llm", "spmd_engine.engine",
                                     "spmd_engine.executor"),
    "spmd_engine.replica_generate": ("spmd_engine.job", "spmd_engine.llm"),
    "spmd_engine.generation_defaults": ("spmd_engine.job", "spmd_engine.llm"),
    "spmd_engine.tokenizer": ("spmd_engine.job", "spmd_engine.engine", "spmd_engine.llm", "spmd_engine.core",
                              "spmd_engine.executor"),
    "spmd_engine.telemetry": ("spmd_engine.core", "spmd_engine.executor", "spmd_engine.job", "spmd_engine.engine"),
    "spmd_engine.models": ("spmd_engine.core", "spmd_engine.executor", "spmd_engine.job", "spmd_engine.engine",
                           "spmd_engine.faults", "spmd_engine.telemetry", "spmd_engine.config",
                           "spmd_engine.distributed", "spmd_engine.api"),
    "spmd_engine.kernels": ("spmd_engine.",),  # a leaf: torch and triton only
}
FOLDERS = {"spmd_engine": REPO / "spmd_engine", "spmd_engine.models": REPO / "models",
           "spmd_engine.kernels": REPO / "kernels"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            found[".".join((package, *parts)).removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path) -> set[str]:
    """Absolute names of the modules `path` imports (anywhere in the file, lazy ones included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


MODULES = _modules()
GRAPH = {name: {m for m in _imports(name, path) if m in MODULES and m != name} for name, path in MODULES.items()}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_downwards(package):
    bad = [f"{name} imports {target}" for name, targets in GRAPH.items()
           if name == package or name.startswith(package + ".")
           for target in targets if not target.startswith(package + ".")
           and any(target == f or target.startswith(f if f.endswith(".") else f + ".") for f in FORBIDDEN[package])]
    assert not bad, bad


# what rank 0 does with a step's logits (logits processors, logprobs, sampler graphs, readback) is the
# executor's StepSampler: the loop hands it logits and gets tokens, it does not orchestrate them
SAMPLING_PARTS = ("spmd_engine.executor.logits_processors", "spmd_engine.executor.logprobs",
                  "spmd_engine.executor.sampler_graphs", "spmd_engine.executor.token_readback")
ENGINE_MAX_LINES = 450


@pytest.mark.parametrize("module", ["spmd_engine.engine", "spmd_engine.step_loop"])
def test_the_loop_leaves_sampling_to_the_step_sampler(module):
    bad = sorted(t for t in GRAPH[module] if t.startswith(SAMPLING_PARTS))
    assert not bad, f"{module} imports {bad}: go through executor/step_sampler.py"


def test_engine_module_stays_short():
    lines = len(MODULES["spmd_engine.engine"].read_text().splitlines())
    assert lines <= ENGINE_MAX_LINES, f"engine.py has {lines} lines (at most {ENGINE_MAX_LINES}): move a concept out"


def test_the_scheduler_takes_no_callbacks():
    """The scheduler decides from its own state and core objects (stop strings: the OutputText given to
    `Scheduler.add`); a callable parameter would let it call back into the engine mid-step."""
    import inspect

    from spmd_engine.core.scheduler import Scheduler

    assert list(inspect.signature(Scheduler.postprocess).parameters) == ["self", "output", "sampled"]
    source = MODULES["spmd_engine.core.scheduler"].read_text()
    assert "Callable" not in source, "core/scheduler.py names Callable: no callbacks into its caller"
    for name, method in inspect.getmembers(Scheduler, inspect.isfunction):
        for param in inspect.signature(method).parameters.values():
            assert "Callable" not in str(param.annotation), f"Scheduler.{name}({param.name}) is a callback"


def test_no_import_cycles_between_modules():
    # a module imports its package's __init__ implicitly; only edges between real modules count
    graph = {name: {t for t in targets if not name.startswith(t + ".")} for name, targets in GRAPH.items()}
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            assert state.get(target) != 1, " -> ".join([*trail[trail.index(target):], target]) \
                if target in trail else f"{name} -> {target}"
            if target not in state:
                visit(target, [*trail, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_models_and_kernels_are_imported_by_one_name():
    """`import models` from the repository root would load a second copy of every module."""
    pattern = re.compile(r"^\s*(from|import) (models|kernels)\b", re.M)
    sources = [*MODULES.values(), *(REPO / "tests").rglob("*.py"), *(REPO / "launch").glob("*.py"), REPO / "run.py"]
    bad = [str(p.relative_to(REPO)) for p in sources if pattern.search(p.read_text())]
    assert not bad, bad


def test_every_package_folder_is_installed_under_spmd_engine():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {name: str(folder.relative_to(REPO)) for name, folder in FOLDERS.items()}
    # every folder holding a module is a package, namespace ones (no __init__.py) included
    folders = {name.rpartition(".")[0] if path.name != "__init__.py" else name for name, path in MODULES.items()}
    assert set(setuptools["packages"]) == folders


def test_an_installed_package_named_like_a_top_level_folder_wins_that_name(tmp_path):
    """With the checkout first on sys.path (`python run.py`, pytest), `import kernels` must still find an
    installed regular package of that name (Hugging Face's, which transformers >= 5.25 imports with its
    modeling code), not this repository's folder: so models/ and kernels/ carry no __init__.py."""
    import subprocess
    import sys

    for name in ("models", "kernels"):
        assert not (REPO / name / "__init__.py").exists(), name
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("WHO = 'installed'\n")
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; "
            "import kernels, models, spmd_engine.kernels.reference; "
            "print(kernels.WHO, models.WHO, spmd_engine.kernels.reference.__file__)")
    out = subprocess.run([sys.executable, "-c", code, str(REPO), str(tmp_path)], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[:2] == ["installed", "installed"]
    assert out[2] == str(REPO / "kernels" / "reference.py")
