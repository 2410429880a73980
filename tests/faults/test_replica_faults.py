"""Data-parallel replicas keep the fault rules: a replica's rank that dies mid-job ends every rank within
seconds with one line naming it, the rows finished before stay in outputs.jsonl, and resume=true
completes the job with every request once."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.faults.engine_runs import greedy
from tests.faults.launches import finish, outputs_rows, start_plain
from tests.faults.test_rank_faults import SEEN, SILENT, fault_args


@pytest.mark.slow
def test_a_dead_replica_ends_every_rank_and_keeps_the_finished_rows(fault_ckpt: Path, tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    token_prompts = [[10 + i, 11, 12, 13] for i in range(40)]
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in token_prompts))
    args = fault_args(fault_ckpt, prompts, tmp_path / "job", 1, "kill", timeout_s=60)
    launch = start_plain("dp2-kill1", [*args, "data_parallel_size=2", "sampling.max_tokens=4"], tmp_path)
    finish([launch], timeout_s=150)
    assert launch.returncodes == [1, -9], launch.describe()
    assert launch.procs[0].ended - launch.procs[1].ended < 15, launch.describe()  # heartbeats, not dist_timeout_s
    lines = launch.error_lines()
    assert len(lines) == 1 and re.fullmatch(rf"error: rank 1 stopped at step \d+ {re.escape(SILENT)}{SEEN}",
                                            lines[0]), launch.describe()
    rows = outputs_rows(tmp_path / "job")
    indices = [r["index"] for r in rows]
    assert len(set(indices)) == len(indices) and all(len(r["token_ids"]) == 4 for r in rows), rows
    assert 1 <= len(rows) < 40, rows

    # resume=true on the same dir with both replicas: every request once, the earlier rows unchanged
    resumed = start_plain("dp2-resume", [*args[:-3], "data_parallel_size=2", "sampling.max_tokens=4", "resume=true"],
                          tmp_path)
    finish([resumed], timeout_s=150)
    assert resumed.returncodes == [0, 0], resumed.describe()
    final = outputs_rows(tmp_path / "job")
    assert [r["index"] for r in final] == list(range(40)) and all(row in final for row in rows)
    reference = [o.token_ids for o in greedy(fault_ckpt, token_prompts, 4, max_model_len=64, max_num_seqs=1)]
    assert [r["token_ids"] for r in final] == reference
