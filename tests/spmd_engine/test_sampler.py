"""The sampler: greedy, temperature, top-k, top-p, and the determinism rule (docs/RELIABILITY.md):
a row's token depends on its own logits, parameters, seed and counter only, whatever the batch."""
import itertools

import numpy as np
import pytest
import torch

from spmd_engine.executor.sampler import (NUCLEUS_ROUNDS, TOP_K_FAST_MAX, Sampler, SamplingRow, _apply_top_k_top_p,
                                          _race, _sample_top_k, path_of, request_seed, seed_bits)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def row(i, t=1.0, p=1.0, k=-1, seed=None, counter=0):
    return SamplingRow(i, t, p, k, i if seed is None else seed, counter)


def sample(logits, rows):
    return Sampler(DEVICE).sample(logits.to(DEVICE), rows)


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    out = sample(logits, [row(i, t=0.0) for i in range(5)])
    assert np.array_equal(out, logits.argmax(-1).numpy())


def test_top_k_one_is_greedy_even_hot():
    logits = torch.randn(4, 30)
    out = sample(logits, [row(i, t=5.0, k=1) for i in range(4)])
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


def test_vanishing_temperature_is_greedy_not_nan():
    logits = torch.randn(6, 40)
    out = sample(logits, [row(i, t=1e-300) for i in range(6)])
    assert np.array_equal(out, logits.argmax(-1).numpy())


# --- distributions: deterministic seeds, bounds far from the statistic's spread ------------------

def chi_square(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson's statistic over the tokens with mass; any draw of a token without mass fails outright."""
    n = counts.sum()
    outside = expected_probs == 0
    assert counts[outside].sum() == 0, f"drew tokens outside the support: {np.nonzero(counts * outside)[0]}"
    e = expected_probs[~outside] * n
    return float(((counts[~outside] - e) ** 2 / e).sum())


PROBS = np.array([0.05, 0.4, 0.2, 0.3, 0.04, 0.01])
N_DRAWS = 6000


def _expected(t: float = 1.0, k: int = -1, p: float = 1.0) -> np.ndarray:
    q = PROBS ** (1.0 / t)
    q = q / q.sum()
    order = np.argsort(-q, kind="stable")
    keep = np.zeros(len(q), dtype=bool)
    keep[order[: (k if k > 0 else len(q))]] = True
    q = np.where(keep, q, 0.0) / np.where(keep, q, 0.0).sum()
    mass_before = np.cumsum(q[order]) - q[order]
    nucleus = np.zeros(len(q), dtype=bool)
    nucleus[order[mass_before < p]] = True
    q = np.where(nucleus, q, 0.0)
    return q / q.sum()


@pytest.mark.parametrize("t,k,p", [(1.0, -1, 1.0), (0.5, -1, 1.0), (2.0, -1, 1.0), (1.0, 3, 1.0),
                                   (1.0, -1, 0.8), (0.7, -1, 0.6), (1.5, 4, 0.9)])
@pytest.mark.parametrize("vary", ["seed", "counter"])
def test_draws_follow_the_distribution(t, k, p, vary):
    """chi-square with 5 or fewer degrees of freedom stays far below 40 (p ~ 1e-7) for a right
    sampler; a wrong temperature, cut or a biased stream lands in the hundreds."""
    logits = torch.log(torch.tensor(PROBS, dtype=torch.float32)).expand(N_DRAWS, len(PROBS)).contiguous()
    if vary == "seed":  # many requests, each's first token
        rows = [row(i, t=t, k=k, p=p, seed=1000 + i) for i in range(N_DRAWS)]
    else:  # one request's successive tokens
        rows = [row(i, t=t, k=k, p=p, seed=42, counter=i) for i in range(N_DRAWS)]
    counts = np.bincount(sample(logits, rows), minlength=len(PROBS))
    assert chi_square(counts, _expected(t, k, p)) < 40, counts


def test_the_check_catches_a_wrong_distribution():
    """The bound above is tight enough: sampling at temperature 1 fails the temperature-2 check."""
    logits = torch.log(torch.tensor(PROBS, dtype=torch.float32)).expand(N_DRAWS, len(PROBS)).contiguous()
    counts = np.bincount(sample(logits, [row(i, seed=1000 + i) for i in range(N_DRAWS)]), minlength=len(PROBS))
    assert chi_square(counts, _expected(2.0)) > 200


def test_nucleus_rows_that_need_many_rounds_still_land_in_it():
    # a flat tail holding most of the mass outside a tiny nucleus forces rejections (and the fallback)
    logits = torch.full((300, 1000), 0.0)
    logits[:, 0] = 8.0  # ~0.75 of the mass
    out = sample(logits, [row(i, p=0.5) for i in range(300)])
    assert (out == 0).all()


# --- the determinism rule ---------------------------------------------------------------------

def test_issue_11_seeded_top_p_row_ignores_a_top_k_neighbour():
    """Issue 11: temperature 1.5, top_p 0.5, seeded: a top_k=40 row joining the batch changed the
    seeded row's tokens from the first one (every row switched to the sort path)."""
    gen = torch.Generator().manual_seed(11)
    for counter in range(40):
        logits = 3 * torch.randn(2, 500, generator=gen)
        seeded = row(7, t=1.5, p=0.5, seed=1234, counter=counter)
        alone = sample(logits[1:], [seeded])[0]
        with_top_k = sample(logits, [row(3, t=1.0, k=40, counter=counter), seeded])[1]
        assert with_top_k == alone, f"token {counter}"


def _mixed_rows(counter: int) -> list[SamplingRow]:
    """Every path and several temperatures; seeded rows and rows with engine-drawn seeds."""
    return [
        row(0, t=0.0),  # greedy
        row(1, t=1.0, k=40, seed=11, counter=counter),  # top-k
        row(2, t=0.8, p=0.9, seed=12, counter=counter),  # top-p (rejection)
        row(3, t=1.3, seed=13, counter=counter),  # plain temperature
        row(4, t=1.5, p=0.5, seed=1234, counter=counter),  # the issue's row
        row(5, t=0.7, k=5, p=0.8, seed=15, counter=counter),  # top-k and top-p
        row(6, t=1.0, p=0.3, seed=request_seed(0, 0, 6), counter=counter),  # unseeded request
        row(7, t=2.0, seed=request_seed(0, 0, 7), counter=counter),  # unseeded request
        row(8, t=1.0, p=0.5, seed=2**64 - 1, counter=counter),  # flat tail: several rejection rounds
        row(9, t=0.9, k=TOP_K_FAST_MAX + 1, p=0.7, seed=19, counter=counter),  # top-k past the topk cap: sort
        row(10, t=1.1, k=200, p=0.95, seed=20, counter=counter),  # a wide topk next to k=5 and k=40 rows
    ]


def _mixed_logits(counter: int) -> torch.Tensor:
    logits = 2 * torch.randn(11, 300, generator=torch.Generator().manual_seed(counter))
    logits[8] = 0.0
    logits[8, 0] = 6.9  # ~0.75 of the mass on token 0 of 300: draws outside the nucleus are common
    return logits


@pytest.mark.parametrize("counter", [0, 1, 17])
def test_every_row_draws_the_same_token_alone_and_in_any_batch(counter):
    logits, rows = _mixed_logits(counter), _mixed_rows(counter)
    alone = [sample(logits[i : i + 1], [r])[0] for i, r in enumerate(rows)]
    assert sample(logits, rows).tolist() == alone
    rng = np.random.default_rng(counter)
    for size in (2, 3, 5, 9, 11):
        for _ in range(4):
            pick = rng.permutation(len(rows))[:size]
            got = sample(logits[torch.tensor(pick)], [rows[i] for i in pick])
            assert got.tolist() == [alone[i] for i in pick], (size, pick.tolist())
    # the same rows repeated (a batch of one kind) changes nothing either
    for i, r in enumerate(rows):
        assert set(sample(logits[i : i + 1].expand(4, -1), [r] * 4).tolist()) == {alone[i]}


def test_draws_are_a_function_of_seed_and_counter():
    logits = torch.zeros(1, 1000)  # uniform: every token equally likely, so the noise alone decides

    def draw(seed, counter):
        return sample(logits, [row(0, seed=seed, counter=counter)])[0]

    assert draw(5, 3) == draw(5, 3)
    assert len({draw(5, c) for c in range(20)}) > 15  # successive tokens draw afresh
    assert len({draw(s, 0) for s in range(20)}) > 15  # so do other seeds
    assert len({draw(s << 32, 0) for s in range(1, 20)}) > 15  # the seed's high 32 bits count
    assert draw(-1, 0) == draw(2**64 - 1, 0)  # the seed's 64 bits, as torch.manual_seed reads them


def test_seed_bits_and_request_seeds():
    assert seed_bits(2**64 - 1) == -1 and seed_bits(2**63) == -(2**63) and seed_bits(5) == 5
    seeds = {request_seed(0, 0, i) for i in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**64 for s in seeds)
    assert request_seed(0, 0, 3) == request_seed(0, 0, 3)
    assert len({request_seed(0, 0, 3), request_seed(1, 0, 3), request_seed(0, 9, 3), request_seed(-1, 0, 3)}) == 4


def test_noise_rounds_are_independent_streams():
    """A rejected nucleus draw redraws from another stream of the same row (not the same noise)."""
    from spmd_engine.executor.sampler import gumbel_noise
    seeds = torch.tensor([3], device=DEVICE)
    counters = torch.tensor([0], device=DEVICE)
    rounds = torch.stack([gumbel_noise(seeds, counters, r, 4000)[0] for r in range(NUCLEUS_ROUNDS + 1)]).cpu()
    corr = torch.corrcoef(rounds)
    assert (corr - torch.eye(len(rounds))).abs().max() < 0.1
    assert 0.5 < rounds.mean() < 0.65  # Gumbel mean: Euler's 0.577


def test_the_nucleus_fallback_keeps_the_distribution_and_the_batch_independence(monkeypatch):
    """A slowly decaying distribution with a small nucleus: each rejection cuts little, so some rows
    exhaust the rejection rounds and take the sort (with their own noise round); their draws still
    follow the renormalised nucleus, and each row draws the same alone."""
    import spmd_engine.executor.sampler as sampler_module
    vocab, n = 400, 4000
    logits = (-0.01 * torch.arange(vocab, dtype=torch.float32)).expand(n, vocab).contiguous()
    sorted_rows = []
    apply = sampler_module._apply_top_k_top_p
    monkeypatch.setattr(sampler_module, "_apply_top_k_top_p",
                        lambda z, ks, ps: (sorted_rows.append(z.shape[0]), apply(z, ks, ps))[1])
    rows = [row(i, p=0.1, seed=i) for i in range(n)]
    out = sample(logits, rows)
    if DEVICE.type == "cpu":  # CUDA's fallback is the kernel's bisection (tests/kernels/test_sampling_noise.py)
        assert sum(sorted_rows) > 20  # the fallback ran (about 2.5 % of the rows)
    p = torch.softmax(logits[0].double(), dim=0).numpy()
    nucleus = np.cumsum(p) - p < 0.1  # 11 tokens
    expected = np.where(nucleus, p, 0.0) / p[nucleus].sum()
    assert chi_square(np.bincount(out, minlength=vocab), expected) < 50  # 10 degrees of freedom
    alone = [sample(logits[i : i + 1], [rows[i]])[0] for i in range(400)]
    assert alone == out[:400].tolist()


# --- the top-k fast path (topk instead of a sort) and the sync-free paths ------------------------

def _keys(n, offset=0):
    seeds = torch.tensor([seed_bits(1000003 * i + offset) for i in range(n)], device=DEVICE)
    return seeds, torch.arange(n, device=DEVICE) * 3


@pytest.mark.parametrize("vocab", [50, 3000])
def test_the_top_k_fast_path_draws_the_sort_paths_token(vocab):
    """topk of the group's widest k, each row masking past its own k, top-p inside: the very token the
    sort path draws with the same (round-0) noise, for small and large k, with and without top-p."""
    gen = torch.Generator().manual_seed(vocab)
    ks = [1, 2, 5, 20, 40, 50, 200, 1000, TOP_K_FAST_MAX, 7, 20, 3]
    ps = [1.0, 0.9, 0.5, 0.95, 1.0, 0.3, 0.9, 0.95, 0.99, 0.05, 1.0, 0.8]
    for trial in range(5):
        logits = (2 * torch.randn(len(ks), vocab, generator=gen)).to(DEVICE)
        logits[-1] = 0.01 * torch.randn(vocab, generator=gen)  # nearly flat: the nucleus fills the top-k
        temps = (0.3 + 1.5 * torch.rand(len(ks), generator=gen)).to(DEVICE)
        seeds, counters = _keys(len(ks), trial)
        fast = _sample_top_k(logits, temps, ks, ps, seeds, counters)
        slow = _race(_apply_top_k_top_p(logits / temps[:, None], ks, ps), seeds, counters, 0)
        assert fast.tolist() == slow.tolist(), trial
        # each row alone (a topk of its own k only) draws the same
        alone = [_sample_top_k(logits[i : i + 1], temps[i : i + 1], [ks[i]], [ps[i]], seeds[i : i + 1],
                               counters[i : i + 1]).item() for i in range(len(ks))]
        assert alone == fast.tolist(), trial


def test_paths_follow_the_rows_own_parameters():
    assert path_of(row(0, t=0.0, k=5, p=0.5)) == "greedy"
    assert path_of(row(0, k=TOP_K_FAST_MAX)) == "top_k" and path_of(row(0, k=TOP_K_FAST_MAX + 1)) == "top_k_sort"
    assert path_of(row(0, p=0.95)) == "top_p" and path_of(row(0)) == "plain" and path_of(row(0, k=0)) == "plain"


def test_top_k_past_the_cap_follows_the_distribution():
    """A row with k above the topk cap takes the sort; its draws are still the top-k distribution."""
    vocab, n = TOP_K_FAST_MAX + 200, 3000
    logits = torch.full((n, vocab), -30.0)
    logits[:, :6] = torch.log(torch.tensor(PROBS, dtype=torch.float32))
    out = sample(logits, [row(i, k=TOP_K_FAST_MAX + 100, seed=5000 + i) for i in range(n)])
    expected = np.zeros(vocab)
    expected[:6] = PROBS
    assert (out < 6).mean() > 0.999  # the -30 tail holds ~1e-10 of the mass
    counts = np.bincount(out[out < 6], minlength=6)
    assert chi_square(counts, PROBS) < 40, counts


def test_a_flat_distribution_keeps_every_tied_token_in_the_nucleus():
    """All tokens tie: none is strictly likelier than another, so the nucleus is the whole vocabulary
    (no rejection, no cut at an arbitrary rank), on the rejection path as on the GPU kernel."""
    vocab, n = 50, 5000
    out = sample(torch.zeros(n, vocab), [row(i, p=0.3, seed=77 + i) for i in range(n)])
    assert chi_square(np.bincount(out, minlength=vocab), np.full(vocab, 1.0 / vocab)) < 110  # 49 d.o.f.


def test_top_p_rows_with_a_huge_nucleus_stay_batch_independent():
    """Nearly flat rows (the nucleus of 0.95 holds thousands of tokens) and peaked rows in one batch:
    every row draws alone what it draws in the batch, on its own top-p or top-k path."""
    gen = torch.Generator().manual_seed(5)
    vocab = 4000
    logits = 0.05 * torch.randn(6, vocab, generator=gen)
    logits[3:] = 4 * torch.randn(3, vocab, generator=gen)
    rows = [row(0, p=0.95, seed=1), row(1, t=0.6, p=0.5, seed=2), row(2, k=1000, p=0.95, seed=3),
            row(3, p=0.95, seed=4), row(4, t=0.6, p=0.1, seed=5), row(5, k=TOP_K_FAST_MAX, p=0.9, seed=6)]
    together = sample(logits, rows).tolist()
    assert together == [sample(logits[i : i + 1], [r])[0] for i, r in enumerate(rows)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host synchronisation is a CUDA matter")
def test_sampling_never_waits_for_the_gpu():
    """Every path, alone and mixed, queues without a host sync (async scheduling keeps its overlap):
    torch raises on any synchronising call in this mode."""
    vocab = 151_936
    logits = 2 * torch.randn(64, vocab, device="cuda")
    logits[60:] = 0.0  # flat rows next to peaked ones: rejections and fallbacks for small top_p
    logits[60:, 0] = 6.0
    kinds = [dict(t=0.0), dict(t=0.6), dict(t=0.6, p=0.95), dict(t=1.0, p=0.1), dict(t=0.6, k=20),
             dict(t=0.6, k=50, p=0.9), dict(t=0.6, k=TOP_K_FAST_MAX + 1, p=0.9)]
    mixed = [row(i, seed=i, counter=3, **kinds[i % len(kinds)]) for i in range(64)]
    batches = [mixed] + [[row(i, seed=i, counter=3, **kw) for i in range(64)] for kw in kinds]
    sampler = Sampler(torch.device("cuda"))
    for rows in batches:
        sampler.sample_on_device(logits, rows)  # compile and warm up outside the check
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [sampler.sample_on_device(logits, rows) for rows in batches]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert all(o.shape == (64,) for o in outs)
    assert outs[0].tolist() == [outs[1 + i % len(kinds)][i].item() for i in range(64)]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 148, 255])
def test_row_keys_start_16_byte_aligned_for_any_row_count(n):
    """Triton specialises a pointer on 16-byte alignment: counters 8 bytes off (an odd row count) made
    every sampling kernel compile a second variant mid-job. The sampler's own key copy, whole batch."""
    from spmd_engine.executor.sampler import SamplingBatch

    rows = [row(i, 0.6, seed=7 * i, counter=i + 3) for i in range(n)]
    [keys] = Sampler(torch.device("cpu"))._keys(SamplingBatch.from_rows(rows), [None])
    for t in (keys.seeds, keys.counters, keys.temperatures, keys.top_p):
        assert t.data_ptr() % 16 == 0
    assert keys.counters.tolist() == [i + 3 for i in range(n)] and keys.seeds.shape == keys.counters.shape == (n,)


def test_batch_paths_and_keys_equal_the_rows_one_by_one():
    """SamplingBatch groups rows with array comparisons and packs every group's keys into one copy:
    the same path as `path_of` per row (edge values included), each section 16-byte aligned, and the
    same tokens as one row at a time."""
    from spmd_engine.executor.sampler import PATHS, SamplingBatch, _pack_groups, _unpack_group
    params = itertools.product((0.0, 1e-5 / 2, 1e-5, 0.7), (1.0, 0.95), (-1, 0, 5, TOP_K_FAST_MAX, TOP_K_FAST_MAX + 1))
    rows = [row(i, t, p, k, seed=(-1) ** i * 2**62 + i, counter=i) for i, (t, p, k) in enumerate(params)]
    batch = SamplingBatch.from_rows(rows)
    assert [PATHS[c] for c in batch.paths()] == [path_of(r) for r in rows]
    codes = batch.paths()
    groups = [None] + [np.flatnonzero(codes == k) for k in range(1, len(PATHS))]
    packed, layout = _pack_groups(batch, groups)
    keys = torch.from_numpy(packed)
    for (at, m), members in zip(layout, groups):
        got = _unpack_group(keys, at, m, members is not None)
        for t in (got.seeds, got.counters, got.temperatures, got.top_p):
            assert t.data_ptr() % 16 == 0
        sel = slice(None) if members is None else members
        assert got.seeds.tolist() == [seed_bits(r.seed) for r in np.array(rows, dtype=object)[sel]]
        assert got.temperatures.tolist() == torch.tensor(batch.temperatures[sel], dtype=torch.float32).tolist()
        if members is not None:
            assert got.index.tolist() == members.tolist()
    logits = torch.randn(len(rows), 2048, generator=torch.Generator().manual_seed(3))
    together = Sampler(DEVICE).sample(logits.to(DEVICE), batch)
    alone = [int(Sampler(DEVICE).sample(logits[i:i + 1].to(DEVICE), [r])[0]) for i, r in enumerate(rows)]
    assert together.tolist() == alone


@pytest.mark.parametrize("engine_seed", [0, 12345, 2**64 - 1, -3])
def test_request_seed_is_the_generators_full_range_draw(engine_seed):
    """request_seed reads PCG64's raw output: what numpy's Generator returns for a full-range uint64 draw."""
    for generation, index in ((0, 0), (7, 1), (100_000, 2**40 + 3)):
        entropy = [engine_seed & (2**64 - 1), generation, index]
        want = int(np.random.default_rng(entropy).integers(0, 1 << 64, dtype=np.uint64))
        assert request_seed(engine_seed, generation, index) == want
