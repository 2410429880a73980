"""Run a function on N ranks of a fresh process group (gloo on CPU, or NCCL with one GPU a rank), each
in a process of its own, bounded in time.

A hang must fail the test, never CI: workers still running at the deadline are killed.

gloo workers are forked from a forkserver that imported torch once for the whole test session: a
spawned worker spends ~2 s of CPU importing torch (`python -X importtime -c "import torch"`), on a
2-core machine a second of wall time per worker. NCCL workers are spawned, as CUDA wants a fresh process.
"""
from __future__ import annotations

import multiprocessing
import os
import socket
import time
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed"]  # what the forkserver imports before it forks any worker


def run_on_ranks(fn: Callable[..., None], args: tuple[Any, ...], world_size: int = 2, backend: str = "gloo",
                 timeout_s: float = 120) -> None:
    """Call `fn(rank, *args)` on every rank of a fresh `backend` group of `world_size` processes.

    `fn` must be importable (a module-level function): the workers are not forked from this process.
    They see this process's environment as it is now. With nccl, rank r uses GPU r.
    """
    start_method = "spawn" if backend == "nccl" else _forkserver()
    context = mp.start_processes(_init_and_call,
                                 args=(world_size, backend, _free_port(), fn, args, dict(os.environ)),
                                 nprocs=world_size, join=False, start_method=start_method)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{backend} workers did not finish in {timeout_s}s")


def _forkserver() -> str:
    """The forkserver start method, its preload set before its server starts (at the first use)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return "forkserver"


def _init_and_call(rank: int, world_size: int, backend: str, port: int, fn: Callable[..., None],
                   args: tuple[Any, ...], environ: dict[str, str]) -> None:
    os.environ.clear()  # a forkserver's child starts with the server's environment, not the caller's
    os.environ.update(environ)
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
