"""Puts this checkout's root first on sys.path, so `python launch/bench/NAME.py` runs this checkout's engine.

Why: a script's own folder, not the working directory, heads sys.path, and an installed spmd-engine (an
editable install of another checkout, say) would otherwise be the one measured. Every bench imports this
module before anything of the engine's; it also makes `tests.helpers` importable for the benches that share
a test's fixture.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

if sys.path[:1] != [str(ROOT)]:
    sys.path.insert(0, str(ROOT))
