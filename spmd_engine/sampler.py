"""Token sampling on rank 0 only: greedy, temperature, top-k, top-p, per-request seeds.

Sampling on one rank and sending the tokens in the next plan keeps every rank's sequences
identical without having to keep random generators in step across ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# below this, logits / temperature overflow float32: such rows are greedy (their limit anyway)
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingRow:
    """What the sampler needs of one request (rows align with the logits rows)."""

    seq_id: int
    temperature: float
    top_p: float
    top_k: int  # -1 or 0 = off
    seed: int | None


class Sampler:
    """Draws one token per logits row; seeded requests get a generator of their own."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[int, torch.Generator] = {}

    def forget(self, seq_id: int) -> None:
        self._request_generators.pop(seq_id, None)

    def _generator_for(self, row: SamplingRow) -> torch.Generator:
        if row.seed is None:
            return self.generator
        gen = self._request_generators.get(row.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(row.seed)
            self._request_generators[row.seq_id] = gen
        return gen

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> np.ndarray:
        """logits [N, V] float32 -> token ids [N] (numpy int64)."""
        return self.sample_on_device(logits, rows).cpu().numpy()

    @torch.inference_mode()
    def sample_on_device(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """logits [N, V] -> token ids [N] int64 on the logits' device. Greedy and top-k/temperature
        rows queue without waiting for the GPU; top-p rows wait (once per rejection round)."""
        random_rows = [i for i, r in enumerate(rows) if r.temperature >= MIN_TEMPERATURE]
        if not random_rows:
            return logits.argmax(dim=-1)
        every_row = len(random_rows) == len(rows)
        if every_row:  # the common case: no greedy rows to keep, no row selection
            sub = logits.float()
        else:
            idx = torch.tensor(random_rows, device=logits.device)
            sub = logits.index_select(0, idx).float()
        picked = [rows[i] for i in random_rows]
        temps = {r.temperature for r in picked}
        if len(temps) == 1:
            sub = sub / temps.pop()
        else:
            sub = sub / torch.tensor([r.temperature for r in picked], device=logits.device)[:, None]
        top_ks = [r.top_k for r in picked]
        top_ps = [r.top_p for r in picked]
        if any(k > 0 for k in top_ks):
            drawn = self._race(torch.softmax(_apply_top_k_top_p(sub, top_ks, top_ps), dim=-1), picked)
        elif any(p < 1.0 for p in top_ps):
            drawn = self._sample_nucleus(sub, picked)
        else:
            drawn = self._race(torch.softmax(sub, dim=-1), picked)
        if every_row:
            return drawn
        out = logits.argmax(dim=-1)
        out[idx] = drawn
        return out

    def _noise(self, like: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Exp(1) noise per row: seeded rows from their own generator, the rest from the engine's."""
        noise = torch.empty_like(like)
        seeded = [j for j, r in enumerate(rows) if r.seed is not None]
        if len(seeded) < len(rows):  # one launch for every unseeded row
            noise.exponential_(generator=self.generator)
        for j in seeded:
            noise[j].exponential_(generator=self._generator_for(rows[j]))
        return noise

    def _race(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p (p need not sum to 1)."""
        return (probs / self._noise(probs, rows)).argmax(dim=-1)

    def _sample_nucleus(self, z: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Exact top-p sampling without sorting the vocabulary (a sort of [N, V] costs ms per step).

        Token i is in the nucleus iff the mass of strictly likelier tokens is < top_p, so the nucleus
        is every token whose logit is above some cut. Draw from p over the tokens still allowed; a
        draw outside the nucleus shows that it and every token not likelier are outside, so those
        are excluded and the row draws again. An accepted draw is distributed as p restricted to the
        nucleus, exactly as with the sort. Rows still unresolved after a few rounds use the sort.
        """
        probs = torch.softmax(z, dim=-1)
        top_p = torch.tensor([r.top_p for r in rows], device=z.device, dtype=torch.float32)
        drawn = torch.empty(len(rows), dtype=torch.int64, device=z.device)
        todo = torch.arange(len(rows), device=z.device)
        cut: torch.Tensor | None = None  # per row: tokens with logits <= cut are known to be outside
        for _ in range(NUCLEUS_ROUNDS):
            scores = probs / self._noise(probs, rows)
            if cut is not None:
                scores.masked_fill_(z <= cut[:, None], -1.0)
            candidate = scores.argmax(dim=-1)
            cand_logit = z.gather(1, candidate[:, None])
            likelier = torch.where(z > cand_logit, probs, 0.0).sum(dim=-1)
            accepted = ((likelier < top_p) | (top_p >= 1.0)).cpu()  # top_p 1: no nucleus (rounding aside)
            done = accepted.nonzero().squeeze(1).to(z.device)
            drawn[todo[done]] = candidate[done]
            if bool(accepted.all()):
                return drawn
            rest = (~accepted).nonzero().squeeze(1)
            rest_dev = rest.to(z.device)
            todo, z, probs, top_p = todo[rest_dev], z[rest_dev], probs[rest_dev], top_p[rest_dev]
            cut = cand_logit[rest_dev, 0]
            rows = [rows[j] for j in rest.tolist()]
        masked = _apply_top_k_top_p(z, [-1] * len(rows), top_p.tolist())
        drawn[todo] = self._race(torch.softmax(masked, dim=-1), rows)
        return drawn


NUCLEUS_ROUNDS = 6  # rejection rounds before the sort fallback (most rows finish in the first)


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf (one sort for both)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_ks], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    mask = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    p = torch.tensor(top_ps, device=logits.device, dtype=torch.float32)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    sorted_logits = sorted_logits.masked_fill(mass_before >= p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
