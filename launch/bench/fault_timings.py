"""Measure, on any device, how fast every rank stops after a killed rank, a hang, a raise and SIGINT.

Not a test (CI runs the same cases on CPU): run it by hand, e.g. on two GPUs,
    python launch/bench/fault_timings.py --device cuda --out /tmp/timings
and copy the numbers into docs/RELIABILITY.md. Each case is a plain 2-rank launch, so the exit
time of every rank is seen and nothing but the engine ends the survivors.
"""
from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
from tests.faults.launches import finish, start_plain, wait_for_rows
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

CASES = {  # name -> (fault rank, fault kind, step, dist_timeout_s, SIGINT to rank 0 once 3 rows are written)
    "kill-rank1": (1, "kill", 5, 60, False),
    "kill-rank0": (0, "kill", 5, 60, False),
    "raise-rank1": (1, "raise", 5, 60, False),
    "hang-rank1": (1, "hang", 5, 10, False),
    "sigint-rank0-while-rank1-hangs": (1, "hang", 6, 60, True),
    "slow-every-rank": (-1, "slow", 5, 10, False),  # 25 s of host compute on both ranks: must complete (exit 0)
}
SLOW_S = 25


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, required=True)
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    ckpt = make_tiny_checkpoint(opts.out / "ckpt", max_position_embeddings=128, tokenizer=False)
    prompts = opts.out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": [10 + i, 11, 12, 13]}) + "\n" for i in range(8)))
    launches, marks = {}, {}
    for name, (rank, kind, step, timeout_s, _) in CASES.items():
        args = ["model=qwen3", f"model.path={ckpt}", f"prompts_file={prompts}", f"device={opts.device}",
                "sampling.temperature=0", "sampling.max_tokens=2", "sampling.ignore_eos=true", "max_num_seqs=1",
                "num_kv_blocks=64", "max_model_len=64", f"dist_timeout_s={timeout_s}", "log_level=WARNING",
                f"hydra.run.dir={opts.out / name}", f"+fault.rank={rank}", f"+fault.step={step}",
                f"+fault.kind={kind}", f"+fault.seconds={SLOW_S}"]
        launches[name] = start_plain(name, args, opts.out)
    for name, (*_, sigint) in CASES.items():
        if sigint:
            wait_for_rows(opts.out / name, 3, launches[name], timeout_s=150)
            time.sleep(1.0)
            marks[name] = time.monotonic()
            launches[name].procs[0].popen.send_signal(signal.SIGINT)
    finish(list(launches.values()), timeout_s=200)

    report = {}
    for name, launch in launches.items():
        rank = max(0, CASES[name][0])
        ended = [p.ended for p in launch.procs]
        start = marks.get(name, ended[rank] if CASES[name][1] in ("kill", "raise") else None)
        report[name] = {
            "returncodes": launch.returncodes,
            "error_lines": launch.error_lines(),
            "stop_s_after_fault_or_signal": None if start is None or None in ended else round(max(ended) - start, 2),
            "exit_spread_s": None if None in ended else round(max(ended) - min(ended), 2),
        }
    (opts.out / "timings.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
