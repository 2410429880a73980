"""kernels/token_bitmask.py against its torch reference (TRITON_INTERPRET=1 on CPU: tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from spmd_engine.kernels.reference import apply_token_bitmask_reference
from spmd_engine.kernels.token_bitmask import apply_token_bitmask
from tests.kernels.paged_batch import DEVICE


def _allowed(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[M, vocab] bool: bit t of each mask row (True where the mask has no word for t)."""
    out = torch.ones(mask.shape[0], vocab, dtype=torch.bool)
    for i in range(mask.shape[0]):
        for t in range(min(vocab, 32 * mask.shape[1])):
            out[i, t] = bool((int(mask[i, t // 32]) >> (t % 32)) & 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab,words", [(100, 4), (70, 2), (1100, 35)])  # exact, narrower mask, > one block
def test_kernel_matches_reference_and_the_bits(dtype, vocab, words):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    mask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    mask[1] = -1  # everything allowed
    rows = torch.tensor([4, 0, 2])
    expected = apply_token_bitmask_reference(logits.clone(), mask, rows)
    got = apply_token_bitmask(logits.clone().to(DEVICE), mask.to(DEVICE), rows.to(DEVICE)).cpu()
    assert torch.equal(got, expected)
    allowed = _allowed(mask, vocab)
    for i, row in enumerate(rows.tolist()):
        assert torch.equal(torch.isinf(expected[row]), ~allowed[i])
        assert torch.equal(expected[row][allowed[i]], logits[row][allowed[i]])
    assert torch.equal(expected[[1, 3]], logits[[1, 3]])  # rows without a mask row are untouched


def test_no_rows_is_a_no_op_and_bad_shapes_say_which():
    logits = torch.randn(2, 40)
    assert torch.equal(apply_token_bitmask(logits.clone(), torch.zeros(0, 2, dtype=torch.int32),
                                           torch.zeros(0, dtype=torch.int64)), logits)
    with pytest.raises(ValueError, match="mask must be int32"):
        apply_token_bitmask(logits, torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows must be"):
        apply_token_bitmask(logits, torch.zeros(1, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))
