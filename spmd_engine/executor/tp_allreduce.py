"""The tensor-parallel all-reduce: one object per engine that sums the row-parallel partials (and the
embedding's rows), chosen once at start-up by `tp_allreduce` (auto | nccl | symm_mem).

Why a choice: a decode step of Qwen3-8B at TP=2 makes 72 all-reduces of 8 KiB..4 MiB, and at those
sizes NCCL's fixed cost per collective (tens of us) is most of the step's communication time. A
one-shot all-reduce over torch symmetric memory (`torch.distributed._symmetric_memory`: every rank's
buffer is mapped into its peers' address space over NVLink) is one kernel that copies this rank's
partial into its own buffer, waits for the peers at a signal pad, reads every rank's buffer and adds
them. Its host part runs once, at capture time, so it replays inside the decode and piecewise CUDA
graphs like the NCCL kernels. NVLink multicast (multimem ops) is never used: it is off on our machines
(TORCH_SYMM_MEM_DISABLE_MULTICAST=1).

Rules that keep the ranks in step and the sums exact:
- whether a call goes through symmetric memory depends only on its dtype, size and alignment, which
  every rank of the group has alike, so the ranks always pick the same kernel (a mismatch would hang);
- the symm_mem kernels add the ranks' values in rank order 0..N-1 on every rank (torch's
  `load_and_reduce`), so every rank holds the same sum; for 2 ranks that sum is a single IEEE
  addition, which NCCL performs too: float32 partials (`tp_reduce_dtype=float32`) give NCCL's result
  bit for bit;
- what symm_mem cannot take (float16, a message above the buffer, a size not a multiple of 16 bytes,
  a non-contiguous tensor) goes to the process group (NCCL) unchanged.

Op schemas as torch defines them (torch/csrc/distributed/c10d/symm_mem/SymmetricMemory.cpp; kernels in
CUDASymmetricMemoryOps.cu, float32/bf16 only): one_shot_all_reduce_copy_out(symm_buffer, local_input,
reduce_op, group_name, out), one_shot_all_reduce_out(input, reduce_op, group_name, out),
two_shot_all_reduce_out(input, reduce_op, group_name, output) (2, 4, 8 ranks).
"""
from __future__ import annotations

import logging
import socket
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)

TP_ALLREDUCE_CHOICES = ("auto", "nccl", "symm_mem")
# the largest message symmetric memory takes: covers every decode batch of Qwen3-8B up to 512 tokens in
# float32 (512 x 4096 x 4 B = 8 MiB); larger (prefill) messages are bandwidth-bound, where NCCL is good
SYMM_MEM_MAX_BYTES = 8 << 20
# above 2 ranks a one-shot reads every peer's whole message: from this size the two-shot (reduce-scatter
# + all-gather over the same buffers) reads less; at 2 ranks the two move the same bytes, one-shot syncs once
ONE_SHOT_MAX_BYTES_WIDE = 512 << 10
SYMM_MEM_DTYPES = (torch.float32, torch.bfloat16)  # what torch's one/two-shot kernels dispatch on
ALIGN_BYTES = 16  # the kernels' widest vector; sizes and offsets that are multiples of it always pass


class TpAllReduceUnavailable(RuntimeError):
    """symm_mem was asked for explicitly but cannot run here; the message says why (one line)."""


class ProcessGroupAllReduce:
    """`dist.all_reduce` in place over the group: NCCL for CUDA tensors, gloo for CPU tensors."""

    def __init__(self, group: ProcessGroup | None, path: str, reason: str = "") -> None:
        self.group = group
        self.path = path  # nccl | gloo
        self.reason = reason

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, **({"reason": self.reason} if self.reason else {})}

    def close(self) -> None:
        pass


class SymmMemAllReduce:
    """One-shot (or, above 2 ranks and ONE_SHOT_MAX_BYTES_WIDE, two-shot) all-reduce through one
    rendezvoused symmetric buffer of `max_bytes`; anything else through `fallback` (NCCL).

    Returns a new tensor (the sum), never `x` itself: callers use the return value. Inside a CUDA
    graph capture the output is allocated from the graph's pool, as any other intermediate."""

    def __init__(self, group: ProcessGroup, buffer: torch.Tensor, handle: Any, fallback: ProcessGroupAllReduce,
                 one_shot_max_bytes: int, algo: str | None = None) -> None:
        self.group = group
        self.group_name = group.group_name
        self.world_size = group.size()
        self.buffer = buffer  # uint8 [max_bytes], symmetric over `group`
        self.handle = handle  # the rendezvous' handle, kept as long as the buffer
        self.max_bytes = buffer.numel()
        self.fallback = fallback
        self.one_shot_max_bytes = one_shot_max_bytes
        if algo not in (None, "one_shot", "two_shot"):
            raise ValueError(f"algo must be one_shot, two_shot or None, got {algo!r}")
        self.algo = algo  # None: by size; "one_shot" / "two_shot": forced (the benchmark)
        ops = torch.ops.symm_mem
        self._copy_out = getattr(ops, "one_shot_all_reduce_copy_out", None)  # one kernel: copy + reduce
        # torch's out-of-place two-shot kernel is built for 2, 4 and 8 ranks only
        self._two_shot = getattr(ops, "two_shot_all_reduce_out", None) if self.world_size in (2, 4, 8) else None
        self.path = "symm_mem"
        self.reason = ""
        self.calls = {"one_shot": 0, "two_shot": 0, "fallback": 0}  # host calls (a graph counts once, at capture)

    def kernel_for(self, x: torch.Tensor) -> str | None:
        """one_shot | two_shot for a message symmetric memory takes, None for the fallback; the same
        answer on every rank (dtype, shape and layout are alike on all)."""
        if not (x.is_cuda and x.is_contiguous()):
            return None
        return symm_mem_kernel(x.numel() * x.element_size(), x.dtype, self.world_size, self.max_bytes,
                               self.one_shot_max_bytes, self._two_shot is not None, self.algo)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel_for(x)
        if kernel is None:
            self.calls["fallback"] += 1
            return self.fallback(x)
        self.calls[kernel] += 1
        nbytes = x.numel() * x.element_size()
        symm = self.buffer[:nbytes].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        if kernel == "two_shot":
            symm.copy_(x)  # the kernel reduces in the buffers (and leaves the sum there), then writes `out`
            return self._two_shot(symm, "sum", self.group_name, out)
        if self._copy_out is not None and (x.storage_offset() * x.element_size()) % ALIGN_BYTES == 0:
            # copies x into this rank's buffer inside the kernel; needs x as aligned as the buffer
            return self._copy_out(symm, x, "sum", self.group_name, out)
        symm.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce_out(symm, "sum", self.group_name, out)

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "buffer_bytes": self.max_bytes, "one_shot_max_bytes": self.one_shot_max_bytes,
                "backend": _symm_backend(self.buffer.device)}

    def close(self) -> None:
        self.handle = None  # the symmetric allocation goes with its last reference
        self.buffer = torch.empty(0, dtype=torch.uint8)


def symm_mem_kernel(nbytes: int, dtype: torch.dtype, world_size: int, max_bytes: int, one_shot_max_bytes: int,
                    has_two_shot: bool, algo: str | None = None) -> str | None:
    """The symmetric-memory kernel for a contiguous CUDA message of `nbytes` (None: the fallback).

    torch's kernels take float32 and bf16 whose size is a multiple of 4 bytes (16 here: full vectors);
    the message must fit the buffer. One-shot at 2 ranks (it reads the peer's message once, as a two-shot
    would, and syncs once instead of twice) and up to `one_shot_max_bytes` above; two-shot beyond, where
    torch builds it (2, 4, 8 ranks); `algo` forces one of them (the benchmark)."""
    if dtype not in SYMM_MEM_DTYPES or not 0 < nbytes <= max_bytes or nbytes % ALIGN_BYTES:
        return None
    if algo is not None:
        return algo if algo == "one_shot" or has_two_shot else None
    if world_size == 2 or nbytes <= one_shot_max_bytes:
        return "one_shot"
    return "two_shot" if has_two_shot else None


def _symm_backend(device: torch.device) -> str | None:
    try:
        import torch.distributed._symmetric_memory as symm_mem
        return symm_mem.get_backend(device)
    except Exception:  # noqa: BLE001 - only a label for the log and metrics
        return None


@dataclass(frozen=True)
class TpGroup:
    """The tensor-parallel group as the reduce needs it (group=None: the default group)."""

    group: ProcessGroup | None
    rank: int
    size: int

    @property
    def process_group(self) -> ProcessGroup:
        return self.group if self.group is not None else dist.group.WORLD


def symm_mem_buffer_bytes(max_tokens: int, hidden_size: int, reduce_itemsize: int,
                          cap: int = SYMM_MEM_MAX_BYTES) -> int:
    """Bytes of the symmetric buffer: the largest all-reduce of a step (max_tokens x hidden x the widest
    dtype reduced: float32 partials or the activations), capped at `cap` (larger messages go to NCCL),
    rounded up to ALIGN_BYTES."""
    need = max(1, max_tokens) * hidden_size * reduce_itemsize
    nbytes = min(need, cap)
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _local_symm_mem_problem(device: torch.device) -> str | None:
    """Why this rank cannot take part in a symmetric-memory rendezvous (None: it can try)."""
    if device.type != "cuda":
        return f"device is {device.type}, symmetric memory needs CUDA"
    try:
        import torch.distributed._symmetric_memory
    except ImportError as exc:
        return f"torch.distributed._symmetric_memory cannot be imported ({exc})"
    ops = torch.ops.symm_mem
    if not hasattr(ops, "one_shot_all_reduce_out"):
        return f"this torch ({torch.__version__}) has no torch.ops.symm_mem.one_shot_all_reduce_out"
    return None


def _peer_problem(device: torch.device, peers: list[tuple[str, int]]) -> str | None:
    """Why the group's GPUs cannot map each other's memory (None: every pair is peer-accessible)."""
    hosts = {host for host, _ in peers}
    if len(hosts) > 1:
        return f"the tensor-parallel ranks are on {len(hosts)} hosts ({', '.join(sorted(hosts))})"
    mine = device.index if device.index is not None else torch.cuda.current_device()
    if len({index for _, index in peers}) < len(peers):
        return "two tensor-parallel ranks see the same GPU index (one GPU per process, e.g. CUDA_VISIBLE_DEVICES)"
    for _, other in peers:
        if other == mine:
            continue
        if other is None or not 0 <= other < torch.cuda.device_count():
            return f"GPU {other} of a peer is not visible here"
        try:
            if not torch.cuda.can_device_access_peer(mine, other):
                return f"GPU {mine} cannot access GPU {other} (no P2P)"
        except (RuntimeError, AssertionError) as exc:  # a raise here would leave the peers waiting
            return f"GPU {mine} -> GPU {other}: {exc}"
    return None


def _first_problem(problem: str | None, tp: TpGroup) -> str | None:
    """The first rank's problem over the group (every rank gets the same answer), prefixed with its rank."""
    problems: list[str | None] = [None] * tp.size
    dist.all_gather_object(problems, problem, group=tp.group)
    for rank, p in enumerate(problems):
        if p:
            return p if tp.size == 1 else f"tp rank {rank}: {p}"
    return None


def _rendezvous(nbytes: int, device: torch.device, group: ProcessGroup) -> tuple[torch.Tensor, Any]:
    """Allocate `nbytes` of symmetric memory and map it over `group` (collective): (buffer, handle)."""
    import torch.distributed._symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    # older torch needs the group's store registered first; later torch marks that deprecated (and there,
    # registering it turns on a store round trip per op to validate the allocation)
    if (enable is not None and getattr(enable, "__deprecated__", None) is None
            and not symm_mem.is_symm_mem_enabled_for_group(group.group_name)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group.group_name)
    buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    buffer.zero_()
    handle = symm_mem.rendezvous(buffer, group)
    if handle is None:
        raise RuntimeError("rendezvous returned no handle")
    torch.cuda.synchronize(device)
    return buffer, handle


def make_tp_allreduce(mode: str, device: torch.device, tp: TpGroup, buffer_bytes: int,
                      one_shot_max_bytes: int | None = None) -> ProcessGroupAllReduce | SymmMemAllReduce | None:
    """The reduce for `tp_allreduce=mode` (collective over the TP group; None for a group of one rank).

    auto: symm_mem where every rank is on CUDA, the group's GPUs are on one host and peer-accessible,
    and the rendezvous succeeds on every rank; NCCL otherwise (gloo on CPU). symm_mem: the same, but
    TpAllReduceUnavailable (on every rank alike) where it cannot run. Every decision is agreed over the
    group before anyone acts on it, so no rank waits in a rendezvous its peers skipped.
    """
    if mode not in TP_ALLREDUCE_CHOICES:
        raise ValueError(f"tp_allreduce must be one of {'|'.join(TP_ALLREDUCE_CHOICES)}, got {mode!r}")
    if tp.size == 1:
        return None
    fallback = ProcessGroupAllReduce(tp.group, "nccl" if device.type == "cuda" else "gloo")
    if mode == "nccl":
        fallback.reason = "tp_allreduce=nccl"
        return fallback
    if mode == "auto" and device.type != "cuda":
        fallback.reason = "CPU"
        return fallback
    problem = _local_symm_mem_problem(device)
    # every rank makes the same collectives in the same order, whatever it found so far
    gathered: list[tuple[str, int | None] | None] = [None] * tp.size
    dist.all_gather_object(gathered, (socket.gethostname(), device.index), group=tp.group)
    if problem is None:
        problem = _peer_problem(device, gathered)
    problem = _first_problem(problem, tp)
    buffer = handle = None
    if problem is None:
        try:
            buffer, handle = _rendezvous(buffer_bytes, device, tp.process_group)
        except Exception as exc:  # noqa: BLE001 - any failure here means: not on this machine
            text = str(exc).strip()
            problem = f"symmetric-memory rendezvous failed: {text.splitlines()[0] if text else type(exc).__name__}"
            buffer = handle = None
        problem = _first_problem(problem, tp)  # one rank failing means nobody uses it
    if problem is not None:
        if mode == "symm_mem":
            raise TpAllReduceUnavailable(f"tp_allreduce=symm_mem is not available here: {problem}; "
                                         f"use tp_allreduce=auto or nccl")
        fallback.reason = f"symm_mem unavailable: {problem}"
        return fallback
    wide = ONE_SHOT_MAX_BYTES_WIDE if one_shot_max_bytes is None else one_shot_max_bytes
    reducer = SymmMemAllReduce(tp.process_group, buffer, handle, fallback, wide)
    reducer.reason = f"tp_allreduce={mode}"
    return reducer
