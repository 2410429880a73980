"""All-reduce latency per message size: NCCL against torch symmetric memory, eager and inside CUDA graphs.

Why: a decode step of Qwen3-8B at TP=2 makes 72 all-reduces of [batch, 4096] (float32 partials with
the default tp_reduce_dtype, bf16 with `model`); this measures what one costs at each decode batch and a
few prefill sizes, through the engine's own reduce objects (spmd_engine/executor/tp_allreduce.py), so
the table says which path `tp_allreduce` should take where (SYMM_MEM_MAX_BYTES, ONE_SHOT_MAX_BYTES_WIDE).

    torchrun --nproc_per_node=2 launch/bench/bench_allreduce.py                  # 2 GPUs (set the env below)
    torchrun --nproc_per_node=2 launch/bench/bench_allreduce.py --device cpu     # gloo smoke test, tiny sizes

On machines without NVLink multicast: NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1.

Per row, microseconds per all-reduce (the slowest rank's mean): eager = `iters` calls back to back on the
stream, timed by CUDA events; graph = `--graph-ops` (50) calls captured in one CUDA graph, replayed
`--graph-replays` times, divided by both. `exact` compares symm_mem's sum with NCCL's on rank-dependent
random data, bit for bit ("yes" expected at 2 ranks: a sum of two numbers does not depend on the order).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch
import torch.distributed as dist

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
from spmd_engine.distributed import discover_ranks, init_process_group
from spmd_engine.executor.tp_allreduce import (
    ProcessGroupAllReduce,
    SymmMemAllReduce,
    TpAllReduceUnavailable,
    TpGroup,
    make_tp_allreduce,
    symm_mem_buffer_bytes,
)

QWEN3_8B_HIDDEN = 4096
DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_TOKENS = (512, 1024, 2048, 4096)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hidden", type=int, default=None, help="columns per token (default: 4096, Qwen3-8B; cpu: 64)")
    p.add_argument("--decode-tokens", default=None, help="comma-separated token counts (default: 1..256; cpu: 1,2,4)")
    p.add_argument("--prefill-tokens", default=None, help="comma-separated (default: 512..4096; cpu: 16)")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--iters", type=int, default=200, help="eager calls timed per row")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--graph-ops", type=int, default=50, help="all-reduces captured in one CUDA graph")
    p.add_argument("--graph-replays", type=int, default=20)
    p.add_argument("--no-graphs", action="store_true")
    return p.parse_args()


def sizes(args: argparse.Namespace, cpu: bool) -> list[int]:
    decode = args.decode_tokens or ("1,2,4" if cpu else ",".join(map(str, DECODE_TOKENS)))
    prefill = args.prefill_tokens or ("16" if cpu else ",".join(map(str, PREFILL_TOKENS)))
    return [int(t) for t in f"{decode},{prefill}".split(",") if t.strip()]


def slowest(value: float) -> float:
    """The largest of every rank's `value` (a collective over the CPU side)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_eager(reduce, x: torch.Tensor, iters: int, warmup: int) -> float:
    """Mean us per call of `reduce(x)`, `iters` calls queued back to back."""
    device = x.device
    for _ in range(warmup):
        reduce(x)
    sync(device)
    dist.barrier()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            reduce(x)
        end.record()
        end.synchronize()
        return slowest(start.elapsed_time(end) * 1e3 / iters)
    t0 = time.perf_counter()
    for _ in range(iters):
        reduce(x)
    return slowest((time.perf_counter() - t0) * 1e6 / iters)


def time_graph(reduce, x: torch.Tensor, ops: int, replays: int) -> float:
    """Mean us per all-reduce: `ops` calls captured in one graph, the graph replayed `replays` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream (NCCL's and the allocator's first use)
        for _ in range(3):
            reduce(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops):
            reduce(x)
    torch.cuda.synchronize()
    dist.barrier()
    graph.replay()  # first replay uploads the graph
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    us = start.elapsed_time(end) * 1e3 / (replays * ops)
    del graph
    torch.cuda.synchronize()
    dist.barrier()
    return slowest(us)


def exact(nccl: ProcessGroupAllReduce, symm: SymmMemAllReduce, shape: tuple[int, int], dtype: torch.dtype,
          rank: int, device: torch.device) -> bool:
    """symm_mem's sum equals NCCL's bit for bit on every rank (random partials that differ per rank)."""
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    ours = symm(x.clone())
    theirs = nccl(x.clone())
    same = torch.tensor([int(torch.equal(ours, theirs))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def machine_info(device: torch.device, world: int) -> list[str]:
    lines = [(f"host {platform.node()}, python {platform.python_version()}, torch {torch.__version__}, "
              f"{world} ranks, device {device.type}")]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        try:
            import torch.cuda.nccl as nccl_module
            nccl = ".".join(map(str, nccl_module.version()))
        except Exception:  # noqa: BLE001 - a label only
            nccl = "?"
        peers = [j for j in range(torch.cuda.device_count()) if j != device.index
                 and torch.cuda.can_device_access_peer(device.index, j)]
        lines.append(f"GPU {props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}), "
                     f"CUDA {torch.version.cuda}, NCCL {nccl}, GPU {device.index} peers {peers}")
    env = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                          "NCCL_ALGO", "NCCL_PROTO", "CUDA_VISIBLE_DEVICES")}
    lines.append("env " + ", ".join(f"{k}={v}" for k, v in env.items() if v is not None) if any(env.values())
                 else "env: no NCCL / symmetric-memory variables set")
    return lines


def fmt(us: float | None) -> str:
    return "n/a" if us is None else f"{us:.1f}"


def main() -> None:
    args = parse_args()
    info = discover_ranks()
    cuda = args.device == "cuda"
    if info.world_size < 2:
        sys.exit("run it with torchrun --nproc_per_node=2 (or more): an all-reduce needs 2 ranks")
    init_process_group(info, use_cuda=cuda, timeout_s=120)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", info.local_rank) if cuda else torch.device("cpu")
    hidden = args.hidden or (QWEN3_8B_HIDDEN if cuda else 64)
    tokens = sizes(args, not cuda)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    group = TpGroup(None, rank, world)
    base = make_tp_allreduce("nccl", device, group, 0)
    largest = symm_mem_buffer_bytes(max(tokens), hidden, 4, cap=1 << 40)
    try:  # the whole table through symmetric memory, past the engine's SYMM_MEM_MAX_BYTES, to see where it stops paying
        symm = make_tp_allreduce("symm_mem", device, group, largest)
        symm_note = f"symm_mem: {symm.describe()}"
    except TpAllReduceUnavailable as exc:
        symm, symm_note = None, str(exc)
    graphs = cuda and not args.no_graphs
    if rank == 0:
        print("\n".join(machine_info(device, world)))
        print(symm_note)
        print(f"eager: {args.iters} calls per row; graph: {args.graph_ops} all-reduces in one graph x "
              f"{args.graph_replays} replays; us per all-reduce, slowest rank")
        cols = ["tokens", "dtype", "bytes", f"{base.path} eager", "one-shot eager"]
        if graphs:
            cols += [f"{base.path} graph", "one-shot graph", "two-shot graph", "graph speed-up"]
        cols.append("exact")
        print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    with torch.inference_mode():
        for dtype in dtypes:
            for n in tokens:
                x = torch.zeros(n, hidden, dtype=dtype, device=device)  # zeros: in-place sums stay finite
                nbytes = x.numel() * x.element_size()
                row = [str(n), str(dtype).replace("torch.", ""), str(nbytes)]
                row.append(fmt(time_eager(base, x, args.iters, args.warmup)))
                one = two = None
                if symm is not None:
                    symm.algo = "one_shot"
                    one = symm if symm.kernel_for(x) else None
                row.append(fmt(time_eager(one, x, args.iters, args.warmup) if one else None))
                if graphs:
                    nccl_graph = time_graph(base, x, args.graph_ops, args.graph_replays)
                    one_graph = time_graph(one, x, args.graph_ops, args.graph_replays) if one else None
                    if symm is not None:
                        symm.algo = "two_shot"
                        two = symm if symm.kernel_for(x) else None
                    two_graph = time_graph(two, x, args.graph_ops, args.graph_replays) if two else None
                    best = min([t for t in (one_graph, two_graph) if t is not None], default=None)
                    row += [fmt(nccl_graph), fmt(one_graph), fmt(two_graph),
                            f"{nccl_graph / best:.2f}x" if best else "n/a"]
                if symm is not None:
                    symm.algo = "one_shot"
                    row.append("yes" if symm.kernel_for(x) and exact(base, symm, tuple(x.shape), dtype, rank, device)
                               else ("n/a" if not symm.kernel_for(x) else "NO"))
                else:
                    row.append("n/a")
                if rank == 0:
                    print("| " + " | ".join(row) + " |", flush=True)
    if symm is not None:
        symm.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
