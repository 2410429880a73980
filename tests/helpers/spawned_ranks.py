"""Run a function on N ranks of a fresh process group (gloo on CPU, or NCCL with one GPU a rank), each
in a spawned process, bounded in time.

A hang must fail the test, never CI: workers still running at the deadline are killed.
"""
from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_on_ranks(fn: Callable[..., None], args: tuple[Any, ...], world_size: int = 2, backend: str = "gloo",
                 timeout_s: float = 120) -> None:
    """Call `fn(rank, *args)` on every rank of a fresh `backend` group of `world_size` processes.

    `fn` must be importable (a module-level function): the workers are spawned, not forked. With
    nccl, rank r uses GPU r.
    """
    context = mp.start_processes(_init_and_call, args=(world_size, backend, _free_port(), fn, args),
                                 nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{backend} workers did not finish in {timeout_s}s")


def _init_and_call(rank: int, world_size: int, backend: str, port: int, fn: Callable[..., None],
                   args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
