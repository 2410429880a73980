"""Drive a CausalLM through one prefill and N decode steps with a hand-built paged KV cache.

Test-only stand-in for the engine: blocks are handed out from a shuffled pool so block tables are
not contiguous, and sequences of different lengths cross block boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from spmd_engine.models.attention_metadata import AttentionMetadata
from spmd_engine.models.causal_lm import CausalLM


@dataclass
class PagedRun:
    prefill_logits: list[torch.Tensor]  # per prompt: [prompt_len, vocab]
    decode_logits: list[torch.Tensor]  # per step: [num_prompts, vocab]
    generated: list[list[int]]  # per prompt: the tokens fed to the decode steps


def _metadata(positions: list[list[int]], tables: torch.Tensor, block_size: int, is_decode: bool) -> AttentionMetadata:
    """Sequence b computes tokens at `positions[b]` (consecutive, ending at its last position)."""
    slots = [int(tables[b, p // block_size]) * block_size + p % block_size
             for b, pos in enumerate(positions) for p in pos]
    query_lens = torch.tensor([len(p) for p in positions], dtype=torch.int32)
    cu = torch.zeros(len(positions) + 1, dtype=torch.int32)
    cu[1:] = query_lens.cumsum(0)
    seq_lens = torch.tensor([p[-1] + 1 for p in positions], dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), cu_seqlens_q=cu, seq_lens=seq_lens,
        block_tables=tables, max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()),
        block_size=block_size, is_decode=is_decode,
    )


@torch.no_grad()
def run_paged(
    model: CausalLM,
    prompts: list[list[int]],
    num_steps: int,
    block_size: int = 4,
    forced_tokens: list[list[int]] | None = None,
    seed: int = 0,
) -> PagedRun:
    """Prefill all prompts in one batch, then decode `num_steps` tokens per prompt.

    Decode inputs are the greedy tokens (needs logits on this rank) unless `forced_tokens[b]`
    gives them. Logit lists are empty on ranks that get no logits.
    """
    max_len = max(len(p) for p in prompts) + num_steps
    blocks_per_seq = -(-max_len // block_size)
    num_blocks = blocks_per_seq * len(prompts) + 3
    pool = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    tables = pool[: blocks_per_seq * len(prompts)].view(len(prompts), blocks_per_seq).to(torch.int32)
    shape = model.shape
    heads = model.attention_layers()[0].num_kv_heads
    caches = [
        tuple(torch.zeros(num_blocks, block_size, heads, shape.head_dim) for _ in range(2))
        for _ in range(shape.num_layers)
    ]
    model.bind_kv_cache(caches)

    positions = [list(range(len(p))) for p in prompts]
    input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    hidden = model(input_ids, torch.tensor([x for p in positions for x in p]), _metadata(positions, tables,
                                                                                           block_size, False))
    logits = model.compute_logits(hidden)
    run = PagedRun([], [], [[] for _ in prompts])
    if logits is not None:
        run.prefill_logits = list(logits.split([len(p) for p in prompts]))
        last = torch.stack([chunk[-1] for chunk in run.prefill_logits])
    lengths = [len(p) for p in prompts]
    for step in range(num_steps):
        if forced_tokens is not None:
            tokens = [forced_tokens[b][step] for b in range(len(prompts))]
        else:
            tokens = last.argmax(-1).tolist()
        for b, token in enumerate(tokens):
            run.generated[b].append(token)
        step_positions = [[n] for n in lengths]
        hidden = model(torch.tensor(tokens, dtype=torch.int64), torch.tensor(lengths),
                       _metadata(step_positions, tables, block_size, True))
        lengths = [n + 1 for n in lengths]
        last = model.compute_logits(hidden)
        if last is not None:
            run.decode_logits.append(last)
    model.bind_kv_cache([(None, None)] * shape.num_layers)
    return run
