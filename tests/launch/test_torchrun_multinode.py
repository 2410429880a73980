"""launch/torchrun_multinode.sh as two 'nodes' on this machine (static rendezvous, 1 process each)."""
from __future__ import annotations

import socket
import sys
from pathlib import Path

from tests.launch.engine_runs import clean_env, engine_args, read_metrics, run_together, token_ids

TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_match_a_single_process(tiny_ckpt: Path, reference_tokens: list[list[int]], tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    port = str(_free_port())
    cmd = ["bash", "launch/torchrun_multinode.sh", *engine_args(tiny_ckpt), f"hydra.run.dir={out_dir}"]
    run_together([(cmd, clean_env(NNODES="2", NODE_RANK=str(node), NPROC_PER_NODE="1", MASTER="127.0.0.1",
                                  MASTER_PORT=port, PYTHON=sys.executable))
                  for node in range(2)], tmp_path, TIMEOUT_S)
    assert token_ids(out_dir) == reference_tokens
    assert read_metrics(out_dir)["world_size"] == 2
