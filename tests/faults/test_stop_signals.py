"""SIGINT/SIGTERM stop every rank within seconds with one line, even a rank blocked in gloo; the
completions already written survive, and resume=true finishes the job exactly once per request."""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

from tests.faults.engine_runs import greedy
from tests.faults.launches import finish, outputs_rows, start_plain, start_torchrun, wait_for_rows

GOOD = [[20 + i, 21, 22, 23] for i in range(8)]
BAD = {  # line -> words of its one-line error
    1: ('{"prompt_token_ids": [5, 6', "invalid JSON"),
    4: (json.dumps({"prompt_token_ids": [5, 6, 300]}), "outside the vocabulary"),
    7: (json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 0}), "max_tokens"),
}
HANG_STEP = 6  # one request at a time, two tokens each: three good requests finish first


def prompt_lines() -> list[str]:
    good = iter(GOOD)
    return [BAD[i][0] if i in BAD else json.dumps({"prompt_token_ids": next(good)})
            for i in range(len(GOOD) + len(BAD))]


def job_args(ckpt: Path, prompts: Path, job_dir: Path, *extra: str) -> list[str]:
    return ["model=qwen3", f"model.path={ckpt}", f"prompts_file={prompts}", "device=cpu", "dtype=float32",
            "sampling.temperature=0", "sampling.max_tokens=2", "sampling.ignore_eos=true", "max_num_seqs=1",
            "num_kv_blocks=64", "max_model_len=64", "log_level=WARNING", f"hydra.run.dir={job_dir}", *extra]


def test_signals_stop_every_rank_and_resume_completes_the_job(fault_ckpt: Path, tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(prompt_lines()) + "\n")
    hang = ["dist_timeout_s=60", "+fault.rank=1", f"+fault.step={HANG_STEP}", "+fault.kind=hang"]
    plain_dir, torchrun_dir = tmp_path / "plain", tmp_path / "torchrun"
    plain = start_plain("sigint-rank0", job_args(fault_ckpt, prompts, plain_dir, *hang), tmp_path)
    trun = start_torchrun("sigint-group", job_args(fault_ckpt, prompts, torchrun_dir, *hang), tmp_path)
    # rank 1 hangs at HANG_STEP, so rank 0 sits in a gloo all_reduce that would never return
    wait_for_rows(plain_dir, 3, plain, timeout_s=120)
    wait_for_rows(torchrun_dir, 3, trun, timeout_s=120)
    time.sleep(0.5)
    before = outputs_rows(torchrun_dir)
    sent = time.monotonic()
    plain.procs[0].popen.send_signal(signal.SIGINT)  # rank 0 only: rank 1 must learn it from the store
    os.killpg(trun.procs[0].popen.pid, signal.SIGTERM)  # like scancel: torchrun and both ranks get it
    finish([plain, trun], timeout_s=30)

    for launch, expected in ((plain, "rank 0 received SIGINT"), (trun, "(rank 0|ranks 0, 1) received SIGTERM")):
        assert None not in launch.returncodes and 0 not in launch.returncodes, launch.describe()
        assert max(p.ended for p in launch.procs) - sent < 10, launch.describe()
        lines = launch.error_lines()
        assert len(lines) == 1 and re.match(rf"error: {expected} at step {HANG_STEP}; stopped every rank "
                                            r"\(finished requests are kept", lines[0]), launch.describe()
    assert plain.returncodes == [130, 1] and "Traceback" not in plain.all_stderr(), plain.describe()
    assert outputs_rows(torchrun_dir) == before
    # 3 completions, and the bad lines read so far (requests are read as the batch has room)
    done, errors = [r["index"] for r in before if r["error"] is None], {r["index"] for r in before if r["error"]}
    assert len(done) == 3 and {i for i in BAD if i < max(done)} <= errors <= set(BAD), before

    # resume on the same job dir; rank 0 also dawdles past dist_timeout_s before its first plan
    resume = start_plain("resume", job_args(fault_ckpt, prompts, torchrun_dir, "resume=true", "dist_timeout_s=4",
                                            "+fault.rank=0", "+fault.kind=slow_start", "+fault.seconds=6"), tmp_path)
    finish([resume], timeout_s=120)
    assert resume.returncodes == [0, 0], resume.describe()
    rows = outputs_rows(torchrun_dir)
    assert [r["index"] for r in rows] == list(range(len(GOOD) + len(BAD)))
    assert all(row in rows for row in before)  # the earlier rows, unchanged
    reference = [o.token_ids for o in greedy(fault_ckpt, GOOD, 2, max_model_len=64, max_num_seqs=1)]
    assert [r["token_ids"] for r in rows if r["index"] not in BAD] == reference
    for index, (_, words) in BAD.items():
        assert rows[index]["finish_reason"] == "error" and words in rows[index]["error"], rows[index]
