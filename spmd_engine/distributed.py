"""Rank discovery (torchrun, slurm, single process), the process group, and the plan channel.

The process group is created once per process (Hydra multirun jobs reuse it) and torn down at
exit; the step plan always travels over the CPU (gloo) side so that sending it never waits for
queued GPU work.
"""
from __future__ import annotations

import datetime
import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # torchrun | slurm | single
    restart_count: int = 0  # torchrun's TORCHELASTIC_RESTART_COUNT: keeps store keys of restarts apart

    @property
    def is_first(self) -> bool:
        return self.rank == 0


def expand_first_host(nodelist: str) -> str:
    """First host of a slurm nodelist such as 'gpu[003-005,007],cpu01' -> 'gpu003'."""
    first = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if first is None:
        raise ValueError(f"cannot parse slurm nodelist {nodelist!r}")
    prefix, ranges = first.group(1), first.group(3)
    if ranges is None:
        return prefix
    start = ranges.split(",")[0].split("-")[0]
    return prefix + start


def _slurm_master(nodelist: str) -> str:
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=10, check=True).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass
    return expand_first_host(nodelist)


def discover_ranks(env: dict[str, str] | None = None) -> RankInfo:
    """torchrun variables win; then slurm's; otherwise one process."""
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return RankInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                        env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)), "torchrun",
                        int(env.get("TORCHELASTIC_RESTART_COUNT", 0) or 0))
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        addr = env.get("MASTER_ADDR") or _slurm_master(nodelist)
        job = int(env.get("SLURM_JOB_ID", "0") or 0)
        port = int(env.get("MASTER_PORT") or 20000 + job % 20000)
        return RankInfo(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                        addr, port, "slurm")
    return RankInfo(0, 1, 0, "127.0.0.1", 0, "single")


class RendezvousUnreachable(ConnectionError):
    """Nothing answered at the rendezvous address within startup_timeout_s (rank 0 or the launcher's
    agent never started, or stopped before the rendezvous); the message is the job's one line."""


def wait_for_rendezvous(info: RankInfo, timeout_s: float, poll_s: float = 0.2) -> None:
    """Ranks other than 0: return once the store's port accepts a TCP connection, or raise
    RendezvousUnreachable after `timeout_s`.

    Why: torch's store client retries a refused connection for its whole timeout and then once more
    (a rank whose rank 0 died before the rendezvous stayed ~20 minutes); a plain connect, retried
    here, is bounded by the caller's limit and logs nothing.
    """
    if info.rank == 0:  # a plain launch's rank 0 hosts the store; under torchrun the agent does
        return
    deadline = time.monotonic() + timeout_s
    address = (info.master_addr, info.master_port)
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection(address, timeout=max(0.05, min(1.0, left))).close()
            return
        except OSError:
            if left <= poll_s:
                raise RendezvousUnreachable(
                    f"rank {info.rank}: nothing answered at the rendezvous address {address[0]}:{address[1]} "
                    f"within startup_timeout_s={timeout_s:g} (rank 0 did not start, or stopped before the "
                    f"rendezvous)") from None
            time.sleep(poll_s)


def init_process_group(info: RankInfo, use_cuda: bool, timeout_s: float,
                       startup_timeout_s: float | None = None) -> None:
    """Create the default group once per process; on CUDA it has an NCCL and a gloo side.

    `startup_timeout_s` bounds the wait for the rendezvous store to appear (default: `timeout_s`)."""
    if info.world_size == 1 or dist.is_initialized():
        return
    wait_for_rendezvous(info, timeout_s if startup_timeout_s is None else startup_timeout_s)
    backend = "cuda:nccl,cpu:gloo" if use_cuda else "gloo"
    kwargs = {}
    if use_cuda:
        torch.cuda.set_device(info.local_rank)
        kwargs["device_id"] = torch.device("cuda", info.local_rank)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{info.master_addr}:{info.master_port}",
        rank=info.rank,
        world_size=info.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def default_store() -> dist.Store:
    """The default group's rendezvous store (a TCPStore under torchrun, srun or `init_process_group`).

    Why: the replicas of an `LLM.generate` call hand out requests through it as the Hydra job does,
    whoever made the group (the LLM, or the training program that embeds it) and however."""
    return dist.distributed_c10d._get_default_store()


def broadcast_object(obj: object, src: int = 0, group: dist.ProcessGroup | None = None) -> object:
    """Send one picklable object from global rank `src` to every rank of `group` (None: all ranks)
    over the CPU side of the group."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group, device=torch.device("cpu"))
    return box[0]


def broadcast_tensor(t: torch.Tensor, src: int = 0, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Broadcast a tensor in place from global rank `src` over `group` (a CUDA tensor over NCCL: queued,
    the host goes on)."""
    if is_distributed():
        dist.broadcast(t, src=src, group=group)
    return t


def gather_errors(error: str | None, group: dist.ProcessGroup | None = None) -> list[tuple[int, str]]:
    """Every rank's error (or None), so all ranks can agree to stop before heavy work; (rank within
    `group`, error) pairs."""
    if not is_distributed():
        return [(0, error)] if error else []
    errors: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return [(rank, e) for rank, e in enumerate(errors) if e]


def all_reduce_min(value: int, group: dist.ProcessGroup | None = None) -> int:
    """The minimum of an int over the ranks of `group` (None: all; e.g. KV blocks that fit on every GPU)."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)  # CPU tensors -> the gloo side
    return int(t.item())


@dataclass(frozen=True)
class Replica:
    """This rank's model replica: `tp_size` consecutive global ranks from `first_rank`, one of `count`.

    Why a handle: the plan, the sampled tokens and the tensor-parallel sums stay inside a replica
    (its own group), while start-up agreement and the watchdog span every rank. group=None is the
    default group (one replica over all ranks: the old layout, no extra groups made)."""

    index: int
    count: int
    tp_rank: int
    tp_size: int
    group: dist.ProcessGroup | None = None

    @property
    def first_rank(self) -> int:
        """The replica's leader (global rank): its scheduler, its sampler, the plans' source."""
        return self.index * self.tp_size

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0

    def broadcast_object(self, obj: object) -> object:
        """`obj` from the leader to every rank of this replica (the step plan)."""
        return broadcast_object(obj, self.first_rank, self.group) if self.tp_size > 1 else obj

    def broadcast_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return broadcast_tensor(t, self.first_rank, self.group) if self.tp_size > 1 else t


def make_replica(rank: int, world_size: int, dp: int, tp: int, timeout_s: float | None = None) -> Replica:
    """This rank's Replica of `dp` x `tp` = `world_size` ranks; collective: every rank makes every group
    (torch's rule for new_group), so call it on all ranks in the same order."""
    if dp * tp != world_size:
        raise ValueError(f"{dp} replicas x {tp} ranks != {world_size} ranks")
    index, tp_rank = divmod(rank, tp)
    if dp == 1:
        return Replica(0, 1, tp_rank, tp, None)
    mine = None
    for r in range(dp):
        ranks = list(range(r * tp, (r + 1) * tp))
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
        group = dist.new_group(ranks, timeout=timeout) if tp > 1 else None  # one rank needs no group
        if r == index:
            mine = group
    return Replica(index, dp, tp_rank, tp, mine)
