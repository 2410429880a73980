"""tp_allreduce=symm_mem on 2 GPUs: its sums equal NCCL's bit for bit (eager and replayed from a CUDA
graph), every rank holds the same sum, and an engine's greedy tokens equal the NCCL engine's and one GPU's.

Why bitwise: with 2 ranks each output element is one IEEE addition of the two partials, in whatever
order a kernel adds them, so torch's one-shot kernel and NCCL must agree exactly (float32 partials with
the default tp_reduce_dtype, and bf16 ones with `model`: both round the exact sum once).
Run: python -m pytest -q tests/gpu/test_tp_allreduce.py (2 GPUs; multicast off as on our machines).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from spmd_engine.executor.tp_allreduce import (
    SymmMemAllReduce,
    TpGroup,
    make_tp_allreduce,
)
from tests.gpu.engine_setup import (
    GPU,
    MAX_TOKENS,
    NO_MULTICAST,
    multirun_jobs,
    tiny_bf16_checkpoint,
)
from tests.helpers.spawned_ranks import run_on_ranks

pytestmark = GPU + [pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
HIDDEN = 4096
BUFFER_BYTES = 256 * HIDDEN * 4  # Qwen3-8B's largest decode message in float32
# rows x HIDDEN: decode sizes, an odd row count, and one message past the buffer (NCCL fallback)
ROWS = (1, 7, 64, 256, 300)
DTYPES = (torch.float32, torch.bfloat16)


def sums_worker(rank: int, out: Path) -> None:
    """Each (rows, dtype): symm_mem's and NCCL's sums of rank-dependent random partials, eager and from
    one CUDA graph holding both (replayed on new inputs), saved for the main process to compare."""
    device = torch.device("cuda", rank)
    symm = make_tp_allreduce("symm_mem", device, TpGroup(None, rank, 2), BUFFER_BYTES)
    assert isinstance(symm, SymmMemAllReduce), type(symm)
    nccl = symm.fallback
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    results = {}
    with torch.inference_mode():
        for dtype in DTYPES:
            for rows in ROWS:
                x = torch.randn(rows, HIDDEN, generator=gen, device=device).to(dtype)
                eager_symm, eager_nccl = symm(x.clone()), nccl(x.clone())
                kernel = symm.kernel_for(x)
                # graph: static inputs, the two reduces captured together, replayed on fresh values
                a, b = x.clone(), x.clone()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    symm(a.clone()), nccl(b.clone())  # warm-up off the capture stream
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    graph_symm = symm(a)
                    graph_nccl = nccl(b)
                fresh = torch.randn(rows, HIDDEN, generator=gen, device=device).to(dtype)
                for _ in range(2):  # twice: the second replay reuses the signal pads and the buffer
                    a.copy_(fresh)
                    b.copy_(fresh)  # NCCL sums in place: its input is the sum after a replay
                    graph.replay()
                torch.cuda.synchronize()
                results[dtype, rows] = {"kernel": kernel, "eager_symm": eager_symm.cpu(),
                                        "eager_nccl": eager_nccl.cpu(), "graph_symm": graph_symm.cpu(),
                                        "graph_nccl": graph_nccl.cpu(), "fresh": fresh.cpu()}
                del graph
    results["calls"] = dict(symm.calls)
    symm.close()
    torch.save(results, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def sums(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("symm_sums")
    saved = {k: os.environ.get(k) for k in NO_MULTICAST}
    os.environ.update(NO_MULTICAST)  # the spawned ranks inherit it
    try:
        run_on_ranks(sums_worker, (out,), backend="nccl", timeout_s=300)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def check_dtype(sums: list[dict], dtype: torch.dtype) -> None:
    for rows in ROWS:
        r0, r1 = sums[0][dtype, rows], sums[1][dtype, rows]
        expected_kernel = "one_shot" if rows * HIDDEN * dtype.itemsize <= BUFFER_BYTES else None
        assert r0["kernel"] == r1["kernel"] == expected_kernel, (dtype, rows, r0["kernel"])
        for mode in ("eager", "graph"):
            for r in (r0, r1):
                assert torch.equal(r[f"{mode}_symm"], r[f"{mode}_nccl"]), (dtype, rows, mode)
            assert torch.equal(r0[f"{mode}_symm"], r1[f"{mode}_symm"]), (dtype, rows, mode)  # every rank alike
        # the graph summed the fresh inputs: the sum of both ranks' fresh partials, rounded once
        want = (r0["fresh"].float() + r1["fresh"].float()).to(dtype)
        assert torch.equal(r0["graph_symm"], want), (dtype, rows)


def test_float32_partials_sum_exactly_as_nccl_in_and_out_of_graphs(sums):
    check_dtype(sums, torch.float32)
    for ranks in sums:  # symmetric memory was used (not the fallback) where the message fits
        assert ranks["calls"]["one_shot"] > 0 and ranks["calls"]["fallback"] > 0


def test_bf16_partials_sum_exactly_as_nccl_in_and_out_of_graphs(sums):
    check_dtype(sums, torch.bfloat16)


def run_engine(ckpt: Path, out: Path, nproc: int, sweep: list[str]) -> dict[tuple[str, str], tuple[list, dict]]:
    """One launch, a Hydra multirun over `sweep`: (tokens, metrics tp_allreduce) per (tp_allreduce,
    enforce_eager) job."""
    return {(str(m["config"].get("tp_allreduce", "auto")), str(m["config"].get("enforce_eager", False))):
            (tokens, m["tp_allreduce"]) for m, tokens in multirun_jobs(ckpt, out, nproc, ["dtype=bfloat16", *sweep])}


def test_symm_mem_engine_gives_the_nccl_engines_and_one_gpus_tokens(tmp_path):
    ckpt = tiny_bf16_checkpoint(tmp_path / "ckpt")
    two = run_engine(ckpt, tmp_path / "tp2", 2, ["tp_allreduce=nccl,symm_mem,auto", "enforce_eager=false,true"])
    one = run_engine(ckpt, tmp_path / "tp1", 1, [])
    assert len(one) == 1
    (reference, info), = one.values()
    assert info["path"] == "none"
    for eager in ("False", "True"):
        nccl_tokens, nccl_info = two["nccl", eager]
        symm_tokens, symm_info = two["symm_mem", eager]
        auto_tokens, auto_info = two["auto", eager]
        assert nccl_info["path"] == "nccl" and symm_info["path"] == "symm_mem", (nccl_info, symm_info)
        print(f"enforce_eager={eager}: auto picked {auto_info}")
        assert all(len(t) == MAX_TOKENS for t in symm_tokens)
        assert symm_tokens == nccl_tokens == auto_tokens, eager
        assert symm_tokens == reference, eager  # the default tp_reduce_dtype=float32: one GPU's tokens
