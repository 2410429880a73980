"""A slow step is not a hang: steps that compute for longer than dist_timeout_s complete (one process,
every rank, or one rank while the others wait for it); a rank frozen in the middle of such a step is
still found within seconds, named with where it was; and ranks whose rank 0 never comes up leave after
startup_timeout_s, not after torch's store timeout."""
from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

from tests.faults.launches import Launch, finish, outputs_rows, start_plain, wait_for_rows

SLOW_STEP = 4  # with max_num_seqs=1 and max_tokens=2, requests 0 and 1 finish at steps 1 and 3
TIMEOUT_S = 3  # dist_timeout_s: every slow step below computes for more than twice as long
NUM_REQUESTS = 4
SILENT = "without reporting an error (killed, exited or its host failed)"


def args(ckpt: Path, prompts: Path, job_dir: Path, *fault: str, timeout_s: int = TIMEOUT_S) -> list[str]:
    return ["model=qwen3", f"model.path={ckpt}", f"prompts_file={prompts}", "device=cpu", "dtype=float32",
            "sampling.temperature=0", "sampling.max_tokens=2", "sampling.ignore_eos=true", "max_num_seqs=1",
            "num_kv_blocks=64", "max_model_len=64", f"dist_timeout_s={timeout_s}", "log_level=WARNING",
            f"hydra.run.dir={job_dir}", f"+fault.step={SLOW_STEP}", *fault]


def slow(rank: int, seconds: float) -> list[str]:
    return [f"+fault.rank={rank}", "+fault.kind=slow", f"+fault.seconds={seconds}"]


def test_slow_steps_complete_and_a_frozen_rank_is_still_named(fault_ckpt: Path, tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": [10 + i, 11, 12, 13]}) + "\n"
                               for i in range(NUM_REQUESTS)))
    completing = {  # name -> (ranks, fault)
        "single-slow": (1, slow(0, 2.5 * TIMEOUT_S)),  # one process: no peer to wait for
        "every-rank-slow": (2, slow(-1, 2.5 * TIMEOUT_S)),  # both ranks busy in the same forward
        "rank1-slow": (2, slow(1, 2.5 * TIMEOUT_S)),  # rank 0 waits in a collective while rank 1 computes
    }
    launches = {name: start_plain(name, args(fault_ckpt, prompts, tmp_path / name, *fault), tmp_path, world=world)
                for name, (world, fault) in completing.items()}
    # both ranks in a long step (60 s of compute); rank 1 is frozen (SIGSTOP) two seconds into it
    frozen_dir = tmp_path / "frozen1"
    frozen = start_plain("frozen1", args(fault_ckpt, prompts, frozen_dir, *slow(-1, 60), timeout_s=4), tmp_path)
    wait_for_rows(frozen_dir, 2, frozen, timeout_s=120)  # step SLOW_STEP starts right after the second row
    time.sleep(2.0)
    frozen.procs[1].popen.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    finish([Launch("frozen-rank0", frozen.procs[:1])], timeout_s=60)
    frozen.procs[1].popen.kill()
    finish(list(launches.values()) + [frozen], timeout_s=150)

    for name, launch in launches.items():
        assert all(code == 0 for code in launch.returncodes), launch.describe()
        rows = outputs_rows(tmp_path / name)
        assert sorted(r["index"] for r in rows) == list(range(NUM_REQUESTS)), launch.describe()
        assert all(r["error"] is None and len(r["token_ids"]) == 2 for r in rows), rows

    assert frozen.returncodes == [1, -9], frozen.describe()
    assert frozen.procs[0].ended - stopped_at < 10, frozen.describe()  # 2 s of silence + the report's grace
    lines = frozen.error_lines()
    expected = (rf"error: rank 1 stopped at step {SLOW_STEP} {re.escape(SILENT)}; last seen at step {SLOW_STEP} "
                r"at spmd_engine/faults/injection.py:\d+ in compute_for")
    assert len(lines) == 1 and re.fullmatch(expected, lines[0]), frozen.describe()


def test_ranks_whose_rank0_never_comes_leave_after_startup_timeout(fault_ckpt: Path, tmp_path: Path):
    """A plain launch of 3 whose rank 0 died before the rendezvous: ranks 1 and 2 exit 1 with one line
    each after startup_timeout_s, not after the process-group timeout (here 90 s) and torch's retry."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [10, 11]}) + "\n")
    job_args = args(fault_ckpt, prompts, tmp_path / "job", "startup_timeout_s=2", timeout_s=90)
    started = time.monotonic()
    launch = start_plain("no-rank0", job_args, tmp_path, world=3, only=[1, 2])
    finish([launch], timeout_s=60)
    assert launch.returncodes == [1, 1], launch.describe()
    assert max(p.ended for p in launch.procs) - started < 45, launch.describe()  # start-up (~10 s on 2 cores) + 2 s
    for rank, proc in zip((1, 2), launch.procs):
        assert re.fullmatch(rf"error: rank {rank}: nothing answered at the rendezvous address 127\.0\.0\.1:\d+ "
                            r"within startup_timeout_s=2 \(rank 0 did not start, or stopped before the rendezvous\)",
                            "\n".join(proc.error_lines())), launch.describe()
        assert "Traceback" not in proc.stderr and "TCPStore" not in proc.stderr, launch.describe()
