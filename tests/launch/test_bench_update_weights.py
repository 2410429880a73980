"""launch/bench/bench_update_weights.py runs as its docstring shows, here as the CPU smoke run on a tiny checkpoint's
shape: the update timed, its parameters and greedy round trip checked, sleep / wake-up (weights to host) round trip."""
from __future__ import annotations

import subprocess
import sys

from tests.helpers.run_engine import REPO
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint


def test_bench_update_weights_checks_pass_on_cpu(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", arch="qwen3", tokenizer=False, max_position_embeddings=256)
    cmd = [sys.executable, "launch/bench/bench_update_weights.py", "--model", str(checkpoint), "--device", "cpu",
           "--max-tokens", "4", "--repeats", "2", "--sleep-level", "2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "update_weights: median" in proc.stdout and "parameters equal to their source rows: yes" in proc.stdout
    assert "X again equal yes, Y differs yes" in proc.stdout and proc.stdout.rstrip().endswith("check: ok")
