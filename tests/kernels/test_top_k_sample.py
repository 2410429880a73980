"""The Triton top-k draw against its plain-torch reference and the sampler's torch top-k path: the same
token for every row (mixed k, top_p 1 and below, k = 1 and k = the vocabulary, ties, -inf logits, chunks
that overflow their candidate slots), whatever the capacity it was compiled for or the rows beside it."""
import pytest
import torch

from spmd_engine.executor.sampler import _sample_top_k
from spmd_engine.kernels.reference import top_k_sample_reference
from spmd_engine.kernels.top_k_sample import CHUNK, K_CAPS, k_cap_for, scratch_numel, top_k_sample
from tests.kernels.paged_batch import DEVICE, gpu_case

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")  # interpreter


def keys(rows: int, seed: int, ks: list[int], ps: list[float]):
    gen = torch.Generator().manual_seed(seed)
    temps = (0.3 + 1.5 * torch.rand(rows, generator=gen)).to(DEVICE)
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen).to(DEVICE)
    counters = torch.randint(0, 5000, (rows,), generator=gen).to(DEVICE)
    top_ks = torch.tensor((ks * rows)[:rows], dtype=torch.int64, device=DEVICE)
    top_ps = torch.tensor((ps * rows)[:rows], dtype=torch.float64, device=DEVICE)
    return temps, top_ks, top_ps, seeds, counters


def draw(logits, temps, top_ks, top_ps, seeds, counters, k_cap=None):
    k_cap = k_cap or k_cap_for(int(top_ks.max()))
    return top_k_sample(logits, temps, top_ks, top_ps, seeds, counters, k_cap).tolist()


def torch_path(logits, temps, top_ks, top_ps, seeds, counters):
    return _sample_top_k(logits.float(), temps, top_ks.tolist(), top_ps.tolist(), seeds, counters).tolist()


def reference(logits, temps, top_ks, top_ps, seeds, counters):
    return top_k_sample_reference(logits, temps, top_ks, top_ps, seeds, counters).tolist()


@pytest.mark.parametrize("rows,vocab", [(12, 50), (8, 2 * CHUNK + 77), gpu_case(256, 151_936)])
def test_draws_the_torch_top_k_paths_token(rows, vocab):
    """Random logits (no ties): the kernel, its reference and the sampler's torch.topk path agree, for
    mixed k per row (1 to 32), top_p 1 and below, nearly flat rows (the nucleus fills the top-k)."""
    ks = [1, 2, 5, 20, 32, 7, 20, 3, 32, 20, 13, 1]
    ps = [1.0, 0.9, 0.5, 0.95, 1.0, 0.3, 0.95, 0.05, 0.99, 1.0, 0.8, 0.2]
    for trial in range(3):
        gen = torch.Generator().manual_seed(100 * trial + rows)
        logits = 3 * torch.randn(rows, vocab, generator=gen)
        logits[-1] = 0.01 * torch.randn(vocab, generator=gen)
        logits = logits.to(DEVICE)
        args = (logits, *keys(rows, trial, ks, ps))
        got = draw(*args)
        assert got == torch_path(*args), trial
        if DEVICE.type == "cpu":  # the reference loops over rows on the host
            assert got == reference(*args), trial


def test_k_up_to_the_larger_capacity_and_k_the_whole_vocabulary():
    vocab = 100
    gen = torch.Generator().manual_seed(3)
    logits = (2 * torch.randn(6, vocab, generator=gen)).to(DEVICE)
    args = (logits, *keys(6, 3, [100, 128, 64, 33, 100, 1], [1.0, 0.95, 0.5, 0.9, 0.1, 1.0]))
    top_ks = args[2]
    assert draw(*args) == torch_path(logits, args[1], top_ks.clamp(max=vocab), *args[3:]) == reference(
        logits, args[1], top_ks.clamp(max=vocab), *args[3:])
    assert k_cap_for(33) == 128 and k_cap_for(20) == 32


@pytest.mark.parametrize("seed", range(4))
def test_tied_logits_go_to_the_lowest_column(seed):
    """Logits on a coarse grid (as bf16 logits are): ties inside the top-k, at the k-th rank and at the
    nucleus cut. The kernel takes tied logits lowest column first, as the reference's stable sort and the
    sampler's torch path (whose torch.topk alone orders ties as it likes)."""
    rows, vocab = 10, CHUNK + 300
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).round() / 2
    logits[0, 5::9] = -0.0  # zeros of both signs tie
    args = (logits.to(DEVICE), *keys(rows, seed, [1, 3, 20, 32, 8], [1.0, 0.7, 0.95, 0.5, 0.3]))
    got = draw(*args)
    assert got == reference(*args)
    assert got == torch_path(*args)


def test_bf16_ties_at_the_nucleus_cut_draw_the_torch_paths_token():
    """bf16 logits of a flat top (Qwen3's T 0.6, top_k 20, top_p 0.95 at a dummy model's logit scale): most
    rows hold tied logits inside their top-k, many at the k-th rank or the cut; every row the torch path's
    token."""
    rows, vocab = 24, 3000
    gen = torch.Generator().manual_seed(42)
    logits = (0.64 * torch.randn(rows, vocab, generator=gen)).to(torch.bfloat16).to(DEVICE)
    temps, top_ks, top_ps, seeds, counters = keys(rows, 42, [20], [0.95])
    args = (logits, temps.fill_(0.6), top_ks, top_ps, seeds, counters)
    assert draw(*args) == torch_path(*args)


def test_bf16_logits_draw_their_float32_values():
    rows, vocab = 6, 700
    gen = torch.Generator().manual_seed(7)
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(torch.bfloat16)
    args = (logits.to(DEVICE), *keys(rows, 7, [20, 5, 32], [0.95, 1.0, 0.6]))
    assert draw(*args) == reference(args[0].float(), *args[1:])  # the logits on the keys' device


def test_chunks_with_too_many_candidates_and_rows_of_few_finite_logits():
    """A flat chunk (every logit reaches the bound: the exact extraction rounds), a row with fewer finite
    logits than k (min_p or min_tokens masks), a row whose best logits all sit in one chunk."""
    rows, vocab = 4, 2 * CHUNK + 10
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(rows, vocab, generator=gen)
    logits[0, :CHUNK] = 1.0  # 4096 ties in chunk 0
    logits[1] = float("-inf")
    logits[1, [5, 4100, 8200]] = torch.tensor([1.0, 2.0, 0.5])  # three finite logits, k = 20
    logits[2, CHUNK:CHUNK + 40] = 10 + torch.arange(40.0)  # the top 40 in one chunk
    logits[3, ::7] = 0.25  # a tie every 7 columns
    args = (logits.to(DEVICE), *keys(rows, 11, [20, 20, 32, 30], [1.0, 0.9, 0.95, 0.5]))
    assert draw(*args) == reference(*args)
    assert draw(*args)[1] in (5, 4100, 8200)


def test_a_rows_token_ignores_the_capacity_and_its_neighbours():
    rows, vocab = 8, CHUNK + 900
    gen = torch.Generator().manual_seed(5)
    logits = (2 * torch.randn(rows, vocab, generator=gen)).to(DEVICE)
    args = (logits, *keys(rows, 5, [20, 1, 32, 5], [0.95, 1.0, 0.5, 0.9]))
    together = draw(*args, k_cap=K_CAPS[0])
    assert draw(*args, k_cap=K_CAPS[-1]) == together
    alone = [draw(*(t[i:i + 1] for t in args))[0] for i in (0, 3, 6)]
    assert alone == [together[i] for i in (0, 3, 6)]


def test_rows_at_temperature_zero_are_left_alone_and_bad_arguments_raise():
    rows, vocab = 4, 300
    logits = torch.randn(rows, vocab).to(DEVICE)
    temps, top_ks, top_ps, seeds, counters = keys(rows, 1, [20], [0.9])
    temps[1] = 0.0
    out = torch.full((rows,), -7, dtype=torch.int64, device=DEVICE)
    top_k_sample(logits, temps, top_ks, top_ps, seeds, counters, 32, out=out)
    assert out[1].item() == -7 and (out[[0, 2, 3]] >= 0).all()
    with pytest.raises(ValueError, match="top_ps must be"):
        top_k_sample(logits, temps, top_ks, top_ps.float(), seeds, counters, 32)
    with pytest.raises(ValueError, match="k_cap"):
        top_k_sample(logits, temps, top_ks, top_ps, seeds, counters, 20)
    with pytest.raises(ValueError, match="scratch"):
        top_k_sample(logits, temps, top_ks, top_ps, seeds, counters, 32,
                     scratch=torch.zeros(scratch_numel(rows, vocab, 32) - 1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="past the kernel"):
        k_cap_for(129)
