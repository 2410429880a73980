"""tp_allreduce on CPU: the choice made at start-up (gloo on CPU whatever `auto` finds, symm_mem refused on
every rank alike), the buffer bound, and the layers summing through the injected reduce."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spmd_engine.models.parallel import TensorParallel

from spmd_engine.executor.tp_allreduce import (
    SYMM_MEM_MAX_BYTES,
    ProcessGroupAllReduce,
    TpAllReduceUnavailable,
    TpGroup,
    make_tp_allreduce,
    symm_mem_buffer_bytes,
    symm_mem_kernel,
)
from tests.helpers.spawned_ranks import run_on_ranks


def test_buffer_holds_a_steps_largest_message_up_to_the_cap():
    # Qwen3-8B decode at 256 sequences, float32 partials: 4 MiB, under the 8 MiB cap
    assert symm_mem_buffer_bytes(256, 4096, 4) == 256 * 4096 * 4
    # the default step budget (8192 tokens) would need 128 MiB: capped, larger messages go to NCCL
    assert symm_mem_buffer_bytes(8192, 4096, 4) == SYMM_MEM_MAX_BYTES
    assert symm_mem_buffer_bytes(3, 5, 2) == 32  # rounded up to the kernels' 16-byte vectors


@pytest.mark.parametrize("nbytes,dtype,world,two_shot,algo,kernel", [
    (4096 * 4, torch.float32, 2, True, None, "one_shot"),  # decode batch 1, float32 partials
    (256 * 4096 * 4, torch.float32, 2, True, None, "one_shot"),  # 4 MiB at 2 ranks: still one-shot
    (256 * 4096 * 4, torch.bfloat16, 4, True, None, "two_shot"),  # above ONE_SHOT_MAX_BYTES_WIDE at 4 ranks
    (256 * 4096 * 4, torch.float32, 6, False, None, None),  # no two-shot kernel for 6 ranks: NCCL
    (64 * 1024, torch.float32, 6, False, None, "one_shot"),
    (4096 * 2, torch.float16, 2, True, None, None),  # torch's kernels take float32 and bf16 only
    ((8 << 20) + 16, torch.float32, 2, True, None, None),  # past the buffer
    (4104, torch.float32, 2, True, None, None),  # not whole 16-byte vectors
    (0, torch.float32, 2, True, None, None),
    (4096, torch.float32, 2, True, "two_shot", "two_shot"),  # forced (the benchmark)
    (4096, torch.float32, 6, False, "two_shot", None),
])
def test_kernel_choice_depends_only_on_what_every_rank_shares(nbytes, dtype, world, two_shot, algo, kernel):
    assert symm_mem_kernel(nbytes, dtype, world, 8 << 20, 512 << 10, two_shot, algo) == kernel


def test_one_rank_has_no_reduce():
    assert make_tp_allreduce("symm_mem", torch.device("cpu"), TpGroup(None, 0, 1), 1024) is None


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="tp_allreduce must be one of auto|nccl|symm_mem"):
        make_tp_allreduce("custom", torch.device("cpu"), TpGroup(None, 0, 2), 1024)


def choice_worker(rank: int, out: Path) -> None:
    """Every mode on 2 gloo ranks: what each picks, and a sum through TensorParallel with the pick."""
    tp_group = TpGroup(None, rank, 2)
    results = {}
    for mode in ("auto", "nccl"):
        reducer = make_tp_allreduce(mode, torch.device("cpu"), tp_group, 1024)
        tp = TensorParallel(rank, 2, None, reduce=reducer)
        total = tp.all_reduce(torch.full((3, 4), float(rank + 1)))
        results[mode] = (type(reducer).__name__, reducer.describe(), total)
    try:
        make_tp_allreduce("symm_mem", torch.device("cpu"), tp_group, 1024)
        results["symm_mem"] = None
    except TpAllReduceUnavailable as exc:
        results["symm_mem"] = str(exc)
    torch.save(results, out / f"rank{rank}.pt")


def test_cpu_picks_gloo_and_refuses_symm_mem_on_every_rank(tmp_path):
    run_on_ranks(choice_worker, (tmp_path,))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for results in ranks:
        for mode in ("auto", "nccl"):
            kind, info, total = results[mode]
            assert kind == ProcessGroupAllReduce.__name__ and info["path"] == "gloo"
            assert torch.equal(total, torch.full((3, 4), 3.0))
        assert results["symm_mem"] == ("tp_allreduce=symm_mem is not available here: tp rank 0: device is cpu, "
                                       "symmetric memory needs CUDA; use tp_allreduce=auto or nccl")


class _Doubling:
    """A stand-in reduce that returns a new tensor (as the symmetric-memory one does)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * 2


def test_row_parallel_and_embedding_use_the_injected_reduce_and_its_result():
    from spmd_engine.models.layers.embedding import VocabParallelEmbedding
    from spmd_engine.models.layers.linear import RowParallelLinear

    reduce = _Doubling()
    tp = TensorParallel(0, 2, None, torch.float32, reduce=reduce)
    layer = RowParallelLinear(8, 4, tp)
    torch.nn.init.ones_(layer.weight)
    x = torch.ones(3, 4, dtype=torch.bfloat16)  # this rank's half of 8 input features
    layer = layer.to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, torch.full((3, 4), 8.0, dtype=torch.bfloat16))
    embedding = VocabParallelEmbedding(10, 4, tp)
    torch.nn.init.ones_(embedding.weight)
    assert torch.equal(embedding(torch.tensor([0, 1])), torch.full((2, 4), 2.0))
    assert reduce.calls == 2


def disagreeing_worker(rank: int, out: Path) -> None:
    """Ranks that find different things (one lacks symmetric memory; then one fails its rendezvous) still
    make the same collectives and end with the same answer, instead of one waiting in a rendezvous."""
    import spmd_engine.executor.tp_allreduce as mod

    def rendezvous(nbytes, device, group):
        if rank == 1:
            raise RuntimeError("boom\nsecond line")
        return torch.zeros(nbytes, dtype=torch.uint8), object()

    mod._peer_problem = lambda device, peers: None  # CPU ranks: pretend the GPUs see each other
    mod._rendezvous = rendezvous
    answers = []
    for local in ({0: None, 1: "no symmetric memory in this build"}, {0: None, 1: None}):
        mod._local_symm_mem_problem = lambda device, local=local: local[rank]
        try:
            make_tp_allreduce("symm_mem", torch.device("cpu"), TpGroup(None, rank, 2), 1024)
            answers.append(None)
        except TpAllReduceUnavailable as exc:
            answers.append(str(exc))
    torch.save(answers, out / f"rank{rank}.pt")


def test_ranks_that_find_different_things_agree_on_one_answer(tmp_path):
    run_on_ranks(disagreeing_worker, (tmp_path,), timeout_s=60)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    refused = "tp_allreduce=symm_mem is not available here: tp rank 1: {}; use tp_allreduce=auto or nccl"
    assert ranks[0] == ranks[1] == [refused.format("no symmetric memory in this build"),
                                    refused.format("symmetric-memory rendezvous failed: boom")]
