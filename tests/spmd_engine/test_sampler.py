import numpy as np
import torch

from spmd_engine.sampler import Sampler, SamplingRow, _apply_top_k_top_p


def row(i, t=1.0, p=1.0, k=-1, seed=None):
    return SamplingRow(i, t, p, k, seed)


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    out = Sampler(torch.device("cpu"), 0).sample(logits, [row(i, t=0.0) for i in range(5)])
    assert np.array_equal(out, logits.argmax(-1).numpy())


def test_top_k_one_is_greedy_even_hot():
    logits = torch.randn(4, 30)
    out = Sampler(torch.device("cpu"), 0).sample(logits, [row(i, t=5.0, k=1) for i in range(4)])
    assert np.array_equal(out, logits.argmax(-1).numpy())


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    masked = _apply_top_k_top_p(logits, [-1], [0.7])
    assert torch.isfinite(masked[0, :2]).all() and torch.isinf(masked[0, 2:]).all()
    masked = _apply_top_k_top_p(logits, [-1], [0.5])  # the top token alone reaches 0.5
    assert torch.isfinite(masked[0, 0]) and torch.isinf(masked[0, 1:]).all()


def test_top_k_masks_the_tail():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    masked = _apply_top_k_top_p(logits, [2], [1.0])
    assert torch.isfinite(masked[0, [1, 2]]).all() and torch.isinf(masked[0, [0, 3]]).all()


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.7])
    logits = torch.log(probs).expand(4000, 3).contiguous()
    out = Sampler(torch.device("cpu"), 1).sample(logits, [row(i) for i in range(4000)])
    freq = np.bincount(out, minlength=3) / 4000
    assert np.allclose(freq, probs.numpy(), atol=0.03)


def test_temperature_sharpens():
    logits = torch.log(torch.tensor([0.4, 0.6])).expand(3000, 2).contiguous()
    out = Sampler(torch.device("cpu"), 2).sample(logits, [row(i, t=0.2) for i in range(3000)])
    assert (out == 1).mean() > 0.8


def test_per_request_seed_is_reproducible_and_independent_of_batch():
    logits = torch.randn(1, 100)
    a = [Sampler(torch.device("cpu"), s).sample(logits, [row(7, seed=123)])[0] for s in (0, 1)]
    assert a[0] == a[1]  # the engine seed does not matter for a seeded request
    batch = torch.cat([torch.randn(3, 100), logits])
    b = Sampler(torch.device("cpu"), 5).sample(batch, [row(1), row(2), row(3), row(7, seed=123)])
    assert b[3] == a[0]


def test_nucleus_sampling_matches_the_renormalised_nucleus():
    probs = torch.tensor([0.05, 0.4, 0.2, 0.3, 0.04, 0.01])  # top_p 0.8: nucleus {1, 3, 2} (0.7 before 2)
    logits = torch.log(probs).expand(6000, 6).contiguous()
    out = Sampler(torch.device("cpu"), 3).sample(logits, [row(i, p=0.8) for i in range(6000)])
    freq = np.bincount(out, minlength=6) / 6000
    expected = torch.tensor([0.0, 0.4, 0.2, 0.3, 0.0, 0.0]) / 0.9
    assert np.allclose(freq, expected.numpy(), atol=0.03)
    assert freq[[0, 4, 5]].sum() == 0


def test_nucleus_rows_that_need_many_rounds_still_land_in_it():
    # a flat tail holding most of the mass outside a tiny nucleus forces rejections
    logits = torch.full((300, 1000), 0.0)
    logits[:, 0] = 8.0  # ~0.75 of the mass
    out = Sampler(torch.device("cpu"), 4).sample(logits, [row(i, p=0.5) for i in range(300)])
    assert (out == 0).all()


def test_seeded_nucleus_rows_are_reproducible_across_batches():
    logits = torch.randn(1, 200)
    alone = Sampler(torch.device("cpu"), 0).sample(logits, [row(7, p=0.9, seed=5)])[0]
    batch = torch.cat([torch.randn(2, 200), logits])
    together = Sampler(torch.device("cpu"), 9).sample(batch, [row(1, p=0.9), row(2, p=0.5), row(7, p=0.9, seed=5)])
    assert together[2] == alone


def test_vanishing_temperature_is_greedy_not_nan():
    logits = torch.randn(6, 40)
    out = Sampler(torch.device("cpu"), 0).sample(logits, [row(i, t=1e-300) for i in range(6)])
    assert np.array_equal(out, logits.argmax(-1).numpy())
