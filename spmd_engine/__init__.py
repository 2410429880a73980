"""spmd-engine: an LLM inference engine written as one torch.distributed SPMD program.

`spmd_engine.models` and `spmd_engine.kernels` are the repository's top-level `models/` and
`kernels/` folders. An install maps them there (pyproject.toml `package-dir`), so site-packages
gets no generic top-level `models` or `kernels`; in a plain checkout (tests, `python run.py`)
the finder below resolves the same two names to the same folders. Import them only by these
names: `import models` from the repository root would load a second copy of every module.

Neither folder has an `__init__.py` (both are namespace packages): with the checkout on sys.path, a
regular package of the same generic name installed elsewhere still wins the top-level name. Hugging Face's
`kernels`, which transformers >= 5.25 requires and imports with its modeling code, would otherwise resolve
to this repository's `kernels/` and fail to import.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
_FOLDERS = {f"{__name__}.{name}": _PACKAGE_DIR.parent / name for name in ("models", "kernels")}


class _CheckoutFolders(importlib.abc.MetaPathFinder):
    """Finds spmd_engine.models / spmd_engine.kernels at the checkout's top level (their submodules
    then follow the package's __path__ as usual)."""

    def find_spec(self, fullname, path=None, target=None):
        folder = _FOLDERS.get(fullname)
        if folder is None or (_PACKAGE_DIR / folder.name).is_dir() or not folder.is_dir():
            return None  # not ours, or an installed copy already holds it inside the package
        return importlib.machinery.PathFinder.find_spec(fullname, [str(folder.parent)])  # a namespace package


if not any(isinstance(f, _CheckoutFolders) for f in sys.meta_path):
    sys.meta_path.insert(0, _CheckoutFolders())


_PUBLIC = ("LLM", "SamplingParams", "GenerationOutput", "CompletionOutput", "PromptRequest", "StructuredOutputsParams")
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    """`from spmd_engine import LLM, SamplingParams`, imported on first use: `import spmd_engine.config`
    (run.py's rank discovery, the config checks) stays free of torch and transformers."""
    if name in _PUBLIC:
        from spmd_engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
