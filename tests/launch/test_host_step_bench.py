"""launch/bench/host_step_bench.py runs as the README shows: rank 0's real step loop over a stub runner prints the
phase table and the outputs' digest (it broke once when the runner grew a method the stub lacked)."""
from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers.run_engine import REPO


def test_host_step_bench_runs_the_step_loop_to_the_end():
    cmd = [sys.executable, "launch/bench/host_step_bench.py", "--num-seqs", "12", "--max-output-len", "110",
           "--max-input-len", "200", "--profile"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = re.search(r"^12 requests, (\d+) output tokens, (\d+) steps", proc.stdout, re.M)
    assert summary and int(summary.group(1)) >= 12 * 100 and int(summary.group(2)) >= 100, proc.stdout
    assert re.search(r"^decode\s+\d+", proc.stdout, re.M) and re.search(r"^outputs\.jsonl sha256 [0-9a-f]{64}$",
                                                                       proc.stdout, re.M)
    assert "cumulative" in proc.stdout  # the --profile table
