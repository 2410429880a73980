import pytest
import torch

from spmd_engine.models.parallel import TensorParallel


def test_single_needs_no_process_group():
    tp = TensorParallel.single()
    assert (tp.rank, tp.world_size, tp.group, tp.is_first) == (0, 1, None, True)
    x = torch.arange(6.0).view(2, 3)
    assert tp.all_reduce(x) is x
    assert tp.gather_to_first(x, dim=-1) is x


def test_rank_outside_world_is_rejected():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        TensorParallel(rank=2, world_size=2)


def test_reduce_dtype_is_float32_or_none():
    assert TensorParallel(rank=0, world_size=2).reduce_dtype is None
    assert TensorParallel(rank=0, world_size=2, reduce_dtype=torch.float32).reduce_dtype == torch.float32
    with pytest.raises(ValueError, match="reduce_dtype must be None or torch.float32, got torch.float16"):
        TensorParallel(rank=0, world_size=2, reduce_dtype=torch.float16)
