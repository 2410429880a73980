"""A rank that raises, exits, is killed or hangs mid-step: every rank exits non-zero within seconds,
one line names the failing rank and the reason, and the completions finished before are kept."""
from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

from tests.faults.launches import Launch, finish, outputs_rows, start_plain, start_torchrun, wait_for_rows

FAULT_STEP = 5  # with max_num_seqs=1 and max_tokens=2, requests 0 and 1 finish at steps 1 and 3
TIMEOUT_S = 8  # dist_timeout_s: also how long a hang takes to be found
RAISED = f"InjectedFault: injected fault on rank 1 at step {FAULT_STEP}"
SILENT = "without reporting an error (killed, exited or its host failed)"
SEEN = r"(; last seen at step \d+ at \S+:\d+ in \w+( waiting in a collective)?)?"  # if its watchdog polled then
CASES = {  # name -> (launcher, rank, kind, the one error line (regex), the process that prints it)
    "plain-raise1": ("plain", 1, "raise", rf"rank 1 failed at step {FAULT_STEP}: {RAISED}", 0),
    "plain-exit1": ("plain", 1, "exit", rf"rank 1 stopped at step {FAULT_STEP} {re.escape(SILENT)}{SEEN}", 0),
    "plain-kill0": ("plain", 0, "kill",
                    rf"rank 0 stopped at step {FAULT_STEP} without reporting an error \(its process group "
                    r"connections and the rendezvous store it hosts are gone\)", 1),
    "plain-hang1": ("plain", 1, "hang",
                    rf"rank 1 hung at step {FAULT_STEP}: no progress for \d+\.\d s \(dist_timeout_s={TIMEOUT_S}\) at "
                    r"spmd_engine/faults/injection.py:\d+ in before_step "
                    r"while the other ranks waited in collectives", 0),
    "torchrun-raise1": ("torchrun", 1, "raise", rf"rank 1 failed at step {FAULT_STEP}: {RAISED}", 0),
    "torchrun-kill0": ("torchrun", 0, "kill", rf"rank 0 stopped at step {FAULT_STEP} {re.escape(SILENT)}{SEEN}", 0),
}


def fault_args(ckpt: Path, prompts: Path, job_dir: Path, rank: int, kind: str, timeout_s: int = TIMEOUT_S) -> list[str]:
    return ["model=qwen3", f"model.path={ckpt}", f"prompts_file={prompts}", "device=cpu", "dtype=float32",
            "sampling.temperature=0", "sampling.max_tokens=2", "sampling.ignore_eos=true", "max_num_seqs=1",
            "num_kv_blocks=64", "max_model_len=64", f"dist_timeout_s={timeout_s}", "log_level=WARNING",
            f"hydra.run.dir={job_dir}", f"+fault.rank={rank}", f"+fault.step={FAULT_STEP}", f"+fault.kind={kind}"]


def test_every_rank_stops_and_one_line_says_who_and_why(fault_ckpt: Path, tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": [10 + i, 11, 12, 13]}) + "\n" for i in range(6)))
    started = time.monotonic()
    launches: dict[str, Launch] = {}
    for name, (launcher, rank, kind, _, _) in CASES.items():
        args = fault_args(fault_ckpt, prompts, tmp_path / name, rank, kind)
        start = start_plain if launcher == "plain" else start_torchrun
        launches[name] = start(name, args, tmp_path)
    # a frozen rank (SIGSTOP: its sockets stay open, so no collective ever fails) is found by its heartbeat
    frozen_args = fault_args(fault_ckpt, prompts, tmp_path / "plain-freeze1", 1, "hang", timeout_s=60)
    frozen = start_plain("plain-freeze1", frozen_args, tmp_path)
    wait_for_rows(tmp_path / "plain-freeze1", 2, frozen, timeout_s=150)
    frozen.procs[1].popen.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    finish([Launch("frozen-rank0", frozen.procs[:1])], timeout_s=60)
    frozen.procs[1].popen.kill()
    finish(list(launches.values()) + [frozen], timeout_s=150)

    for name, (launcher, rank, kind, expected, printer) in CASES.items():
        launch = launches[name]
        codes = launch.returncodes
        assert None not in codes and 0 not in codes, launch.describe()
        last_exit = max(p.ended for p in launch.procs)
        assert last_exit - started < 120, f"{name} took {last_exit - started:.0f} s\n{launch.describe()}"
        if launcher == "plain":  # survivors follow the failing rank within seconds, not at a timeout
            assert last_exit - min(p.ended for p in launch.procs) < 10, launch.describe()
            assert codes[rank] == {"kill": -9, "exit": 3}.get(kind, 1), launch.describe()
            assert launch.procs[printer].error_lines() == launch.error_lines(), launch.describe()
            assert launch.all_stderr().count("Traceback") == (1 if kind == "raise" else 0), launch.describe()
        lines = launch.error_lines()
        assert len(lines) == 1 and re.fullmatch("error: " + expected, lines[0]), f"{name}: {lines}\n{launch.describe()}"
        rows = outputs_rows(tmp_path / name)
        assert [r["index"] for r in rows][:2] == [0, 1] and all(len(r["token_ids"]) == 2 for r in rows), (name, rows)

    assert frozen.returncodes == [1, -9], frozen.describe()
    assert frozen.procs[0].ended - stopped_at < 15, frozen.describe()  # ~1 s slow step + 5 s silence + grace
    lines = frozen.error_lines()
    expected = rf"error: rank 1 stopped at step \d+ {re.escape(SILENT)}{SEEN}"
    assert len(lines) == 1 and re.fullmatch(expected, lines[0]), frozen.describe()
