"""Host time per layer of the eager Triton attention call of a mixed step, kernel launches stubbed out.

Measures what our wrapper costs on the host (checks, split count, configs, grids, partial buffers,
slicing) apart from Triton's own launch path: every jitted kernel's `kernel[grid]` is replaced by a
no-op, a fresh AttentionMetadata is built per step (as the engine does) and `Attention.attend` runs
for every layer of the step. Runs on CPU (no GPU, no TRITON_INTERPRET) or on a GPU machine:
`python launch/bench/bench_attention_host.py [--device cuda]`. Uses only the layer's public API, so
`--repo OTHER_CHECKOUT` times an older version of the layer the same way.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=28)  # Qwen3-0.6B
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parents[2]),
                        help="checkout whose attention layer to time (default: this one)")
    args = parser.parse_args()
    sys.path.insert(0, args.repo)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET: the launches are stubbed, not interpreted")
    from triton.runtime.jit import JITFunction

    from spmd_engine.models.attention_metadata import AttentionMetadata
    from spmd_engine.models.layers.attention import Attention

    JITFunction.__getitem__ = lambda self, grid: (lambda *a, **k: None)  # noqa: E731 (no launch)
    device = torch.device(args.device)
    hq, hkv, d, block = 16, 8, 128, 16
    print(f"# host us per layer of Attention.attend (Triton launches stubbed), Hq={hq} Hkv={hkv} D={d} bs={block}, "
          f"{args.layers} layers, {args.steps} steps, {device}")
    for num_decode, prompts, prompt_len in ((250, 2, 390), (200, 1, 1024), (8, 1, 512), (0, 2, 512)):
        q_lens = [1] * num_decode + [prompt_len] * prompts
        seq_lens = [1024] * num_decode + [prompt_len] * prompts
        num_tokens, num_seqs = sum(q_lens), len(q_lens)
        max_blocks = 1024 // block + 1
        cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device=device)
        slots = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        layers = []
        for _ in range(args.layers):
            layer = Attention(hq, hkv, d, d**-0.5, "triton")
            caches = torch.zeros(2, 64, block, hkv, d, dtype=torch.bfloat16, device=device)
            layer.k_cache, layer.v_cache = caches.unbind(0)
            layers.append(layer)
        q = torch.zeros(num_tokens, hq * d, dtype=torch.bfloat16, device=device)
        out = torch.empty_like(q)

        def step() -> None:
            attn = AttentionMetadata(slots, cu, lens, tables, max(q_lens), 1024, block, is_decode=False,
                                     num_decode_seqs=num_decode)
            for layer in layers:
                layer.attend(q, None, None, attn, out=out)

        for _ in range(20):
            step()
        runs = []
        for _ in range(args.repeats):  # the best of several runs: the machine may be shared
            started = time.perf_counter()
            for _ in range(args.steps):
                step()
            runs.append((time.perf_counter() - started) / (args.steps * args.layers) * 1e6)
        print(f"{num_decode:4d} decodes + {prompts}x{prompt_len} prompt: {min(runs):7.2f} us per layer (best of "
              f"{args.repeats}; median {sorted(runs)[len(runs) // 2]:.2f})", flush=True)


if __name__ == "__main__":
    main()
