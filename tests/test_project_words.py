"""The tree speaks of the product, not of how it was built, and the benches stay out of the packages.

Why: a design comment that cites when something was measured (a numbered work period or machine loan) means
nothing to a reader of the product; it cites the bench script and the figure instead (`python launch/bench/NAME.py`,
the GPU, the number). And the benches live in launch/bench/: kernels/ holds what the engine runs, and no
product package imports a bench, a launcher or a test.
"""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("spmd_engine", "kernels", "models")
# numbered work periods, machine loans, time on the machines, and the replaced experiment diary ([ ] keeps this
# line itself from matching a plain search for the same words)
PROCESS_WORDS = re.compile(
    r"\bsessions?[ ][0-9]+|\bcalls?[ ][0-9]+|lent[ ](machine|kind)|device[ ]time|one H200 per[ ]call|work[ ]period"
    r"|BENCHMARKS\.md",
    re.IGNORECASE,
)


def tracked_files() -> list[Path]:
    """Every file git tracks in this checkout; the test is skipped outside a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / name for name in out.stdout.decode().split("\0") if name]


def text_of(path: Path) -> str | None:
    """The file's text; None for a binary file (a NUL byte) or one that is gone from the work tree."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return None if b"\0" in data else data.decode("utf-8", errors="replace")


def process_word_lines(path: Path) -> list[str]:
    text = text_of(path)
    if text is None:
        return []
    rel = path.relative_to(REPO)
    return [f"{rel}:{n}: {line.strip()[:160]}" for n, line in enumerate(text.splitlines(), 1)
            if PROCESS_WORDS.search(line)]


def test_no_tracked_file_speaks_of_the_working_process():
    found = [hit for path in tracked_files() if path.resolve() != Path(__file__).resolve()
             for hit in process_word_lines(path)]
    assert not found, "working-process words (cite the bench script and the figure instead):\n" + "\n".join(found)


def script_module_names() -> set[str]:
    """Module names a bench or launcher is imported by when its folder is on sys.path."""
    return {p.stem for folder in (REPO / "launch", REPO / "launch" / "bench") for p in folder.glob("*.py")}


def imported_top_names(source: str) -> set[str]:
    """The top-level module names a Python file imports (absolute imports only; relative ones stay inside)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_benches_stay_out_of_the_product_packages():
    assert sorted(p.name for p in (REPO / "kernels").glob("bench_*.py")) == [], "benches belong in launch/bench/"
    forbidden = {"launch", "tests"} | script_module_names()
    offenders = []
    for package in PRODUCT_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            bad = imported_top_names(path.read_text(encoding="utf-8")) & forbidden
            offenders += [f"{path.relative_to(REPO)} imports {name}" for name in sorted(bad)]
    assert not offenders, "product code imports a bench, a launcher or a test:\n" + "\n".join(offenders)
