import pytest
import torch

from models.parallel import TensorParallel


def test_single_needs_no_process_group():
    tp = TensorParallel.single()
    assert (tp.rank, tp.world_size, tp.group, tp.is_first) == (0, 1, None, True)
    x = torch.arange(6.0).view(2, 3)
    assert tp.all_reduce(x) is x
    assert tp.gather_to_first(x, dim=-1) is x


def test_rank_outside_world_is_rejected():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        TensorParallel(rank=2, world_size=2)
