"""The deferred input ids' feed (kernels/feed_tokens.py) against its torch reference: every fed token
takes its row of the previous step's tokens, every other id is left alone (interpreter on CPU)."""
import pytest
import torch

from spmd_engine.kernels.feed_tokens import BLOCK, feed_tokens
from spmd_engine.kernels.reference import feed_tokens_reference
from tests.kernels.paged_batch import DEVICE


@pytest.mark.parametrize("num_tokens,num_fed", [(1, 1), (5, 0), (7, 3), (BLOCK + 9, 40)])
def test_feed_matches_the_reference(num_tokens, num_fed):
    gen = torch.Generator().manual_seed(num_tokens + num_fed)
    ids = torch.randint(0, 1000, (num_tokens,), generator=gen)
    feed = torch.randint(1000, 2000, (max(num_fed, 1) + 3,), generator=gen)  # room past the rows read
    rows = torch.full((num_tokens,), -1, dtype=torch.int64)
    at = torch.randperm(num_tokens, generator=gen)[:num_fed]
    rows[at] = torch.randperm(num_fed, generator=gen)
    expected = ids.clone()
    feed_tokens_reference(expected, rows, feed)
    assert torch.equal(expected[at], feed[rows[at]]) and (expected != ids).sum() == num_fed
    got = ids.to(DEVICE)
    feed_tokens(got, rows.to(DEVICE), feed.to(DEVICE))
    assert torch.equal(got.cpu(), expected)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="feed_rows must be"):
        feed_tokens(torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), torch.zeros(4))
