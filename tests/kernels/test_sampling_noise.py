"""The Triton sampling-noise kernels against the numpy reference: the same 32-bit hash bit for bit
(the sampler's draws must not depend on which implementation ran), Gumbel noise equal up to log
rounding; and the hash's streams for other seeds, counters and rounds are unrelated."""
import pytest
import torch

from spmd_engine.kernels.reference import gumbel_noise_at_reference, gumbel_noise_reference, sampling_hash_reference
from spmd_engine.kernels.sampling_noise import (BLOCK, NOISE_AT_BLOCK, RACE_CHUNK, gumbel_noise, gumbel_noise_at,
                                                gumbel_race, nucleus_sample, sampling_hash)
from tests.kernels.paged_batch import DEVICE, gpu_case

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")  # interpreter

SEEDS = [0, 1, -1, 2**63 - 1, -(2**63), 0x0123456789ABCDEF, 7 << 32]
COUNTERS = [0, 1, 5, 1 << 31, (1 << 40) + 3, 2**62, 9]


@pytest.mark.parametrize("round_,vocab", [(0, 37), (1, BLOCK + 5), (5, 300), gpu_case(2, 151_936)])
def test_hash_is_bit_identical_to_the_reference(round_, vocab):
    seeds = torch.tensor(SEEDS, dtype=torch.int64, device=DEVICE)
    counters = torch.tensor(COUNTERS, dtype=torch.int64, device=DEVICE)
    bits = sampling_hash(seeds, counters, round_, vocab)
    assert torch.equal(bits, sampling_hash_reference(seeds, counters, round_, vocab))
    assert int(bits.min()) >= 0 and int(bits.max()) < 2**32
    noise = gumbel_noise(seeds, counters, round_, vocab)
    torch.testing.assert_close(noise, gumbel_noise_reference(seeds, counters, round_, vocab), atol=1e-5, rtol=1e-5)
    assert torch.isfinite(noise).all()


def test_empty_batch_and_bad_shapes():
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert gumbel_noise(empty, empty, 0, 10).shape == (0, 10)
    with pytest.raises(ValueError, match="seeds and counters"):
        gumbel_noise(torch.zeros(2, dtype=torch.int64, device=DEVICE), empty, 0, 10)


def test_a_row_hashes_its_columns_to_distinct_values():
    bits = sampling_hash_reference(torch.tensor([5]), torch.tensor([0]), 0, 50_000)
    assert bits.unique().numel() == 50_000  # column -> hash is a bijection for a fixed row


def test_neighbouring_seeds_counters_and_rounds_give_unrelated_streams():
    """Seeds, counters and rounds one apart (and seeds apart only in their high 32 bits) must not
    give shifted or correlated copies of one stream."""
    vocab = 4096
    base = torch.tensor([1000]), torch.tensor([10])

    def uniform(seed, counter, round_=0):
        return sampling_hash_reference(torch.tensor([seed]), torch.tensor([counter]), round_, vocab)[0].double() / 2**32

    ref = uniform(*[int(t) for t in base])
    others = [uniform(1001, 10), uniform(1000, 11), uniform(1000, 10, 1), uniform(1000 + (1 << 32), 10),
              uniform(1000, 10 + (1 << 32)), uniform(10, 1000)]
    for other in others:
        assert abs(torch.corrcoef(torch.stack([ref, other]))[0, 1]) < 0.1
        assert (ref == other).sum() < 3
    # the bits of the whole output are balanced (no stuck bit)
    bits = sampling_hash_reference(torch.arange(64), torch.zeros(64, dtype=torch.int64), 0, 1024)
    ones = torch.stack([(bits >> b) & 1 for b in range(32)]).double().mean(dim=(1, 2))
    assert ((ones - 0.5).abs() < 0.01).all()


def test_gumbel_noise_is_gumbel_distributed():
    noise = gumbel_noise_reference(torch.arange(4), torch.zeros(4, dtype=torch.int64), 0, 50_000).double()
    assert abs(noise.mean().item() - 0.5772) < 0.01  # Euler-Mascheroni
    assert abs(noise.var().item() - torch.pi**2 / 6) < 0.03
    # P(G > 5) = 1 - exp(-exp(-5)): the tail the rare tokens need is there
    assert abs((noise > 5).double().mean().item() - 0.0067153) < 0.0015


@pytest.mark.parametrize("rows,vocab", [(6, 37), (5, 2 * BLOCK + 7), gpu_case(256, 151_936)])
def test_fused_race_equals_logits_over_t_plus_the_noise(rows, vocab):
    """The fused plain draw is exactly argmax(logits / T + gumbel_noise) of the unfused path."""
    gen = torch.Generator().manual_seed(vocab)
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(DEVICE)
    temps = (0.3 + 2 * torch.rand(rows, generator=gen)).to(DEVICE)
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen).to(DEVICE)
    counters = torch.randint(0, 5000, (rows,), generator=gen).to(DEVICE)
    noise = gumbel_noise(seeds, counters, 0, vocab)  # the kernel path the GPU sampler's other rows use
    expected = (logits / temps[:, None] + noise).argmax(dim=-1)
    assert torch.equal(gumbel_race(logits, temps, seeds, counters), expected)
    if DEVICE.type == "cpu":  # and the torch reference, which the CPU sampler uses
        ref = (logits / temps[:, None] + gumbel_noise_reference(seeds, counters, 0, vocab)).argmax(dim=-1)
        assert torch.equal(gumbel_race(logits, temps, seeds, counters), ref)


def test_fused_race_spans_blocks_and_skips_minus_inf():
    logits = torch.full((2, BLOCK + 10), float("-inf"), device=DEVICE)
    logits[0, [3, BLOCK + 4]] = 0.0  # two finite tokens in two blocks
    logits[1, 5] = 1.0
    temps = torch.ones(2, device=DEVICE)
    keys = torch.arange(2, device=DEVICE)
    got = gumbel_race(logits, temps, keys, keys).tolist()
    assert got[0] in (3, BLOCK + 4) and got[1] == 5
    assert got == (logits + gumbel_noise(keys, keys, 0, logits.shape[1])).argmax(dim=-1).tolist()


def test_fused_race_leaves_its_scratch_as_it_found_it():
    """Launch after launch (row counts up and down, and after the scratch grew) every draw is the
    argmax of its own logits, and the per-row scratch is back to empty / 0 between launches."""
    from spmd_engine.kernels.sampling_noise import _PICK_EMPTY, _race_state

    gen = torch.Generator().manual_seed(7)
    vocab = 3 * RACE_CHUNK + 5  # four chunks, the last one partial
    for rows in (3, 1, 2, 0, 3):
        if rows == 0:  # a larger scratch (what more rows than it holds make): a fresh one, ready as well
            assert _race_state(torch.empty(0, device=DEVICE).device, 300)[0].numel() >= 300
            continue
        logits = torch.randn(rows, vocab, generator=gen).to(DEVICE)
        logits[0, :] = 0.5  # one row whose logits tie everywhere: the noise alone decides
        temps = torch.ones(rows, device=DEVICE)
        seeds = torch.arange(rows, device=DEVICE) + 11
        counters = torch.full((rows,), rows, device=DEVICE)
        expected = (logits / temps[:, None] + gumbel_noise(seeds, counters, 0, vocab)).argmax(dim=-1)
        assert torch.equal(gumbel_race(logits, temps, seeds, counters), expected)
        picks, arrivals = _race_state(logits.device, rows)
        assert picks.numel() >= rows and bool((picks == _PICK_EMPTY).all()) and bool((arrivals == 0).all())


def test_fused_race_skips_rows_at_temperature_zero():
    """The sampler graphs' padding rows (temperature 0): skipped whole, their token slot untouched, the
    scratch still clean, and the real rows' tokens those of a launch without them; bf16 logits race as
    their float32 values do."""
    from spmd_engine.kernels.sampling_noise import _PICK_EMPTY, _race_state

    gen = torch.Generator().manual_seed(3)
    vocab = 2 * RACE_CHUNK + 9
    logits = torch.randn(5, vocab, generator=gen).to(DEVICE)
    temps = torch.tensor([0.7, 1.3, 0.0, 0.9, 0.0], device=DEVICE)
    seeds, counters = torch.arange(5, device=DEVICE) + 5, torch.arange(5, device=DEVICE)
    got = gumbel_race(logits, temps, seeds, counters, out=torch.full((5,), -7, device=DEVICE))
    assert got[2].item() == got[4].item() == -7
    real = [0, 1, 3]
    assert torch.equal(got[real], gumbel_race(logits[real], temps[real], seeds[real], counters[real]))
    picks, arrivals = _race_state(logits.device, 5)
    assert bool((picks == _PICK_EMPTY).all()) and bool((arrivals == 0).all())
    half = logits[real].to(torch.bfloat16)
    assert torch.equal(gumbel_race(half, temps[real], seeds[real], counters[real]),
                       gumbel_race(half.float(), temps[real], seeds[real], counters[real]))


@pytest.mark.parametrize("width,vocab", [(7, 50), (NOISE_AT_BLOCK + 3, 5000), gpu_case(1024, 151_936)])
def test_noise_at_columns_equals_the_gathered_noise(width, vocab):
    """The top-k path's noise at a few columns per row is the full noise at those columns, bit for bit
    (the same per-element code), and the reference agrees."""
    seeds = torch.tensor(SEEDS, dtype=torch.int64, device=DEVICE)
    counters = torch.tensor(COUNTERS, dtype=torch.int64, device=DEVICE)
    gen = torch.Generator().manual_seed(width)
    cols = torch.stack([torch.randperm(vocab, generator=gen)[:width] for _ in SEEDS]).to(DEVICE)
    at = gumbel_noise_at(seeds, counters, 3, cols)
    assert torch.equal(at, gumbel_noise(seeds, counters, 3, vocab).gather(1, cols))
    ref = gumbel_noise_at_reference(seeds, counters, 3, cols)
    assert torch.equal(ref, gumbel_noise_reference(seeds, counters, 3, vocab).gather(1, cols))
    torch.testing.assert_close(at, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cols must be"):
        gumbel_noise_at(seeds[:2], counters[:2], 0, cols)


# --- the nucleus kernel: rejection rounds and the bisection fallback on the device ----------------

def _nucleus_inputs(rows, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    temps = (0.5 + torch.rand(rows, generator=gen)).to(DEVICE)
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen).to(DEVICE)
    counters = torch.randint(0, 5000, (rows,), generator=gen).to(DEVICE)
    return gen, temps, seeds, counters


@pytest.mark.parametrize("rows,vocab", [(10, 300), (6, 2 * RACE_CHUNK + 77), gpu_case(256, 151_936)])
def test_nucleus_kernel_draws_the_torch_paths_token(rows, vocab):
    """The GPU top-p draw equals the sampler's torch path (rejection rounds with the same noise
    rounds): peaked, random, near-flat and one-dominant-token rows, small and large top_p."""
    from spmd_engine.executor.sampler import NUCLEUS_ROUNDS, _sample_nucleus
    gen, temps, seeds, counters = _nucleus_inputs(rows, vocab, vocab)
    logits = 3 * torch.randn(rows, vocab, generator=gen)
    logits[0] = 0.01 * torch.randn(vocab, generator=gen)  # nearly flat: a nucleus of most tokens
    logits[1] = 0.0
    logits[1, vocab - 1] = 6.0  # one token holds much of the mass: draws outside are common
    top_p = torch.tensor([0.95, 0.5, 0.9, 0.3, 0.05, 0.99] * (rows // 6 + 1))[:rows].to(DEVICE)
    logits = logits.to(DEVICE)
    got = nucleus_sample(logits, temps, top_p, seeds, counters, NUCLEUS_ROUNDS)
    assert got.tolist() == _sample_nucleus(logits / temps[:, None], top_p, seeds, counters).tolist()


def test_nucleus_kernel_fallback_finds_the_exact_nucleus(monkeypatch):
    """Rows that exhaust the rejection rounds: the kernel's bisection finds the cut the torch path's
    sort finds (the same token with the same round-NUCLEUS_ROUNDS noise), and the fallback ran."""
    import spmd_engine.executor.sampler as sampler_module
    rows, vocab = 24, 400
    _, temps, seeds, counters = _nucleus_inputs(rows, vocab, 1)
    # a slow decay and a tiny nucleus: each rejection cuts few tokens, most rows reach the fallback
    logits = (-0.0005 * torch.arange(vocab, dtype=torch.float32)).expand(rows, vocab).contiguous().to(DEVICE)
    top_p = torch.full((rows,), 0.005, device=DEVICE)
    sorted_rows = []
    apply = sampler_module._apply_top_k_top_p
    monkeypatch.setattr(sampler_module, "_apply_top_k_top_p",
                        lambda z, ks, ps: (sorted_rows.append(z.shape[0]), apply(z, ks, ps))[1])
    expected = sampler_module._sample_nucleus(logits / temps[:, None], top_p, seeds, counters)
    assert sum(sorted_rows) >= 5  # 8 of the 24 rows
    got = nucleus_sample(logits, temps, top_p, seeds, counters, sampler_module.NUCLEUS_ROUNDS)
    assert got.tolist() == expected.tolist()
    assert got.max().item() < 10  # inside the nucleus


@pytest.mark.parametrize("chunked_rounds", [1, 2, 6])
def test_nucleus_kernel_rounds_split_between_chunked_and_row_programs(chunked_rounds):
    """Where the rounds run (spread over (row, chunk) programs, or a program per row) changes no
    token: rows accepted in round 0, in later rounds and by the fallback, against the torch path."""
    from spmd_engine.executor.sampler import NUCLEUS_ROUNDS, _sample_nucleus
    rows, vocab = 12, RACE_CHUNK + 300
    gen, temps, seeds, counters = _nucleus_inputs(rows, vocab, 5)
    logits = 0.02 * torch.randn(rows, vocab, generator=gen)  # nearly flat rows: small top_p rejects often
    logits[:4] = 3 * torch.randn(4, vocab, generator=gen)
    logits = logits.to(DEVICE)
    top_p = torch.tensor([0.9, 0.5, 0.2, 0.05, 0.3, 0.1, 0.02, 0.01, 0.6, 0.002, 0.15, 0.05]).to(DEVICE)
    got = nucleus_sample(logits, temps, top_p, seeds, counters, NUCLEUS_ROUNDS, chunked_rounds=chunked_rounds)
    assert got.tolist() == _sample_nucleus(logits / temps[:, None], top_p, seeds, counters).tolist()


def test_nucleus_kernel_counts_every_chunks_mass():
    """Rows whose mass is spread evenly over four chunks (the last partial) and top_p values that reject
    about half of the candidates: each chunk's share of the mass likelier than the candidate and of the
    softmax sum (round 0's mass pass makes both) decides the row, so a chunk left out or counted twice
    changes tokens against the torch path."""
    from spmd_engine.executor.sampler import NUCLEUS_ROUNDS, _sample_nucleus
    rows, vocab = 16, 3 * RACE_CHUNK + 5
    gen, temps, seeds, counters = _nucleus_inputs(rows, vocab, 9)
    logits = (0.5 * torch.randn(rows, vocab, generator=gen)).to(DEVICE)
    top_p = (0.2 + 0.6 * torch.rand(rows, generator=gen)).to(DEVICE)
    got = nucleus_sample(logits, temps, top_p, seeds, counters, NUCLEUS_ROUNDS)
    assert got.tolist() == _sample_nucleus(logits / temps[:, None], top_p, seeds, counters).tolist()


def test_nucleus_kernel_keeps_tied_tokens_and_checks_shapes():
    """All tokens tie: none is strictly likelier, so every token is in the nucleus (no bisection cut
    at an arbitrary rank); bad shapes raise."""
    rows, vocab = 8, 40
    _, temps, seeds, counters = _nucleus_inputs(rows, vocab, 2)
    got = nucleus_sample(torch.zeros(rows, vocab, device=DEVICE), temps, torch.full((rows,), 0.2, device=DEVICE),
                         seeds, counters, 6)
    assert len(set(got.tolist())) > 4
    with pytest.raises(ValueError, match="top_ps"):
        nucleus_sample(torch.zeros(2, 5, device=DEVICE), temps[:2], temps[:1], seeds[:2], counters[:2], 6)
