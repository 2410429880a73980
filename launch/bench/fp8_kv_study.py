"""Why fp8 K/V flips SmolLM2-135M's top-1 where it does: a fake-quantization study (prints a table; not a test).

Why: launch/bench/fp8_kv_accuracy.py measures the engine's fp8 cache (94.5 % top-1 agreement against 99 %
asked). This asks what any 1-byte K/V encoding could reach on the same model and texts: K and V are
rounded through an encoding inside the uncached forward (torch attention, float32), with nothing else
changed, and the top-1 at every position is compared with the unrounded model's. Encodings: e4m3 with
the engine's calibrated per-(layer, KV head) scales, the same after an orthonormal Hadamard rotation of
each head (q and k rotated alike, so q.k is unchanged; v rotated and the output rotated back), int8 with
a scale per token and head, bfloat16; then e4m3 in one layer at a time (how the flips spread over layers).

    python launch/bench/fp8_kv_study.py          # ~6 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
from spmd_engine.executor.kv_cache import FP8_CALIBRATION_TOKENS, FP8_DTYPE, calibrate_fp8_kv_scales
from spmd_engine.models.attention_metadata import AttentionMetadata

MARGIN = 0.5  # logits: "near a tie" below this top-1/top-2 margin of the unrounded model


def hadamard(n: int) -> torch.Tensor:
    """The n x n orthonormal Sylvester-Hadamard matrix (n a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    if h.shape[0] != n:
        raise ValueError(f"head_dim {n} is not a power of two")
    return h / n ** 0.5


def e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] through float8_e4m3fn with a scale per head ([H])."""
    s = scale.view(1, -1, 1)
    return (x / s).to(FP8_DTYPE).float() * s


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    s = x.abs().amax(dim=2, keepdim=True).clamp_min(1e-12) / 127
    return (x / s).round().clamp(-127, 127) * s


class Rounding:
    """What one run does to K and V: `k`/`v` map [T, H, D] -> [T, H, D] (None: untouched), `rotate`
    applies the Hadamard rotation first, `layers` limits it to those layer indices (None: all)."""

    def __init__(self, k=None, v=None, rotate: bool = False, layers: set[int] | None = None) -> None:
        self.k, self.v, self.rotate, self.layers = k, v, rotate, layers


def install(model, plan: list[Rounding | None]) -> None:
    """Wrap every attention layer's uncached `attend` so it rounds K/V per `plan[0]` (a one-item box)."""
    for index, layer in enumerate(model.attention_layers()):
        rot = hadamard(layer.head_dim)

        def attend(q, k, v, attn, out=None, layer=layer, index=index, rot=rot):
            r = plan[0]
            t, d = q.shape[0], layer.head_dim
            q, k, v = q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
            if r is None or (r.layers is not None and index not in r.layers):
                return layer._attend_new_tokens_only(q, k, v, attn).reshape(t, -1)
            if r.rotate:
                q, k, v = q @ rot.T, k @ rot.T, v @ rot.T
            k = r.k(k, layer.k_scale) if r.k else k
            v = r.v(v, layer.v_scale) if r.v else v
            o = layer._attend_new_tokens_only(q.contiguous(), k.contiguous(), v.contiguous(), attn)
            return (o @ rot if r.rotate else o).reshape(t, -1)

        layer.attend = attend


@torch.inference_mode()
def top1(model, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, top-1 minus top-2 logit) at every position but each text's last, one uncached forward per text."""
    idx, margin = [], []
    for s in seqs:
        n = len(s)
        attn = AttentionMetadata(slot_mapping=torch.full((n,), -1), seq_lens=torch.tensor([n], dtype=torch.int32),
                                 cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                                 block_tables=torch.zeros(1, 1, dtype=torch.int32), max_query_len=n, max_seq_len=n,
                                 block_size=16, is_decode=False)
        logits = model.compute_logits(model(torch.tensor(s), torch.arange(n), attn)).float()[:-1]
        top = logits.topk(2, dim=-1)
        idx.append(top.indices[:, 0])
        margin.append(top.values[:, 0] - top.values[:, 1])
    return torch.cat(idx), torch.cat(margin)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-text", type=int, default=512)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from fp8_kv_accuracy import real_texts  # launch/bench/ is this script's directory
    from spmd_engine.models.gguf import embedded_model_dir
    from spmd_engine.models.loader import load_safetensors_weights
    from spmd_engine.models.parallel import TensorParallel
    from spmd_engine.models.registry import build_model

    model_dir = embedded_model_dir()
    model = build_model(json.loads((Path(model_dir) / "config.json").read_text()), TensorParallel.single(), "torch")
    load_safetensors_weights(model, model_dir)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    seqs = [tokenizer.encode(text, add_special_tokens=False)[: args.tokens_per_text] for _, text in real_texts()]
    scales = calibrate_fp8_kv_scales(model, model.shape.vocab_size, FP8_CALIBRATION_TOKENS, torch.device("cpu"))
    for layer, (k_scale, v_scale) in zip(model.attention_layers(), scales):
        layer.k_scale, layer.v_scale = k_scale, v_scale  # read by the rounding only: no cache is bound
    plan: list[Rounding | None] = [None]
    install(model, plan)
    base, margin = top1(model, seqs)
    near = margin < MARGIN
    print(f"SmolLM2-135M-Instruct, float32, torch {torch.__version__}; {len(seqs)} texts x {args.tokens_per_text} "
          f"tokens, {base.numel()} positions, {near.float().mean().item():.1%} of them within {MARGIN} logits of a tie")

    bf16 = lambda x, s: x.to(torch.bfloat16).float()  # noqa: E731
    int8 = lambda x, s: int8_per_token(x)  # noqa: E731
    runs = {
        "e4m3 K+V (the engine's encoding)": Rounding(e4m3, e4m3),
        "e4m3 K only": Rounding(k=e4m3),
        "e4m3 V only": Rounding(v=e4m3),
        "e4m3 K+V, Hadamard-rotated heads": Rounding(e4m3, e4m3, rotate=True),
        "e4m3 K only, rotated": Rounding(k=e4m3, rotate=True),
        "e4m3 V only, rotated": Rounding(v=e4m3, rotate=True),
        "int8 per token K+V, rotated": Rounding(int8, int8, rotate=True),
        "int8 per token K+V": Rounding(int8, int8),
        "bfloat16 K+V": Rounding(bf16, bf16),
    }
    print(f"\n{'K/V rounded through':<36} {'top-1 agree':>12} {'flips':>6} {f'agree, margin>={MARGIN}':>19}")
    for name, rounding in runs.items():
        started = time.perf_counter()
        plan[0] = rounding
        agree = top1(model, seqs)[0] == base
        print(f"{name:<36} {agree.float().mean().item():>12.2%} {int((~agree).sum()):>6} "
              f"{agree[~near].float().mean().item():>19.2%}   ({time.perf_counter() - started:.0f} s)", flush=True)

    flips = []
    for index in range(len(model.attention_layers())):
        plan[0] = Rounding(e4m3, e4m3, rotate=True, layers={index})
        flips.append(int((top1(model, seqs)[0] != base).sum()))
    print(f"\ne4m3 K+V (rotated) in one layer only, flips per layer 0..{len(flips) - 1}: {flips}")
    print(f"min {min(flips)} ({min(flips) / base.numel():.2%}), median {sorted(flips)[len(flips) // 2]}, "
          f"max {max(flips)} ({max(flips) / base.numel():.2%}) of {base.numel()} positions")


if __name__ == "__main__":
    main()
