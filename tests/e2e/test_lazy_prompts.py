"""A prompts file far bigger than a chunk is read as the engine asks for work: the first row comes as soon
as for a tiny file, and the process's peak memory does not grow with the file.

Two jobs run side by side (tiny model, max_tokens=1), one on 5 lines and one on a ~75 MB file, each
stopped once its first row is in outputs.jsonl; the peak RSS (VmHWM) is read just before. Reading the
whole file first (bytes, lines, then every parsed request) costs several times the file's size.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.engine_args import tiny_args, write_prompts_file
from tests.helpers.run_engine import engine_command, engine_env

BIG_LINES = 150_000
LINE = '{"prompt_token_ids": [' + ", ".join(str(100 + i % 150) for i in range(100)) + "]}\n"  # ~520 bytes


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(engine_command(args), cwd=cwd, env=engine_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _first_row(proc: subprocess.Popen, outputs: Path, started: float, timeout_s: float) -> tuple[float, float]:
    """(seconds from the start to the first row, peak RSS MiB then); the process is killed after."""
    try:
        while time.monotonic() - started < timeout_s:
            if outputs.exists() and outputs.stat().st_size > 0:
                return time.monotonic() - started, _peak_rss_mib(proc.pid)
            assert proc.poll() is None, f"the job exited ({proc.returncode}) before its first row"
            time.sleep(0.02)
        raise AssertionError(f"no row within {timeout_s} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow  # two jobs side by side
def test_a_big_prompts_file_starts_at_once_in_bounded_memory(tiny_qwen3: Path, tmp_path: Path):
    small = write_prompts_file(tmp_path / "small.jsonl", [LINE.strip()] * 5)
    big = tmp_path / "big.jsonl"
    big.write_text(LINE * BIG_LINES)
    keys = {"sampling.max_tokens": 1, "max_num_seqs": 8}
    started = time.monotonic()
    procs = {name: _start(tiny_args(tiny_qwen3, tmp_path / name, path, **keys), tmp_path)
             for name, path in (("small", small), ("big", big))}
    seen = {name: _first_row(proc, tmp_path / name / "outputs.jsonl", started, 240) for name, proc in procs.items()}
    (small_s, small_mib), (big_s, big_mib) = seen["small"], seen["big"]
    file_mib = big.stat().st_size / (1 << 20)
    assert big_mib - small_mib < 0.25 * file_mib, (seen, file_mib)
    assert big_s - small_s < 10, seen  # a byte scan to count the lines, then the first chunk
