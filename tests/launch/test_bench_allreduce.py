"""launch/bench/bench_allreduce.py runs as documented: 2 gloo ranks under torchrun print the machine and one
table row per message (the GPU columns need 2 GPUs; this keeps the script runnable)."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.run_engine import LAUNCH_VARS, REPO


def test_bench_allreduce_smoke_on_two_cpu_ranks():
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "launch/bench/bench_allreduce.py", "--device", "cpu", "--iters", "3", "--warmup", "1", "--dtypes", "float32",
           "--decode-tokens", "1,2", "--prefill-tokens", "8"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("host ") and "2 ranks, device cpu" in line for line in lines), proc.stdout
    assert "| tokens | dtype | bytes | gloo eager | one-shot eager | exact |" in lines
    rows = [line.split(" | ") for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert [(r[0], r[1], r[2]) for r in rows] == [("| 1", "float32", "256"), ("| 2", "float32", "512"),
                                                  ("| 8", "float32", "2048")]
    assert all(float(r[3]) > 0 and r[4] == "n/a" for r in rows)
