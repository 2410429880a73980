"""Token sampling on rank 0 only: greedy, temperature, top-k, top-p, per-request seeds.

Sampling on one rank and sending the tokens in the next plan keeps every rank's sequences
identical without having to keep random generators in step across ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> np.ndarray:
        """logits [N, V] float32 -> token ids [N] (numpy int64)."""
        greedy = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if r.temperature > 0]
        if not random_rows:
            return greedy.cpu().numpy()
        idx = torch.tensor(random_rows, device=logits.device)
        sub = logits.index_select(0, idx).float()
        temps = torch.tensor([rows[i].temperature for i in random_rows], device=logits.device)
        sub = sub / temps[:, None]
        top_ks = [rows[i].top_k for i in random_rows]
        top_ps = [rows[i].top_p for i in random_rows]
        if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
            sub = _apply_top_k_top_p(sub, top_ks, top_ps)
        probs = torch.softmax(sub, dim=-1)
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p.
        noise = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            noise[j].exponential_(generator=self._generator_for(rows[i]))
        drawn = (probs / noise).argmax(dim=-1)
        out = greedy.clone()
        out[idx] = drawn
        return out.cpu().numpy()


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
