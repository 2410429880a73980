"""FP8 weight (W8A8) accuracy on the real SmolLM2-135M-Instruct weights, per scaling recipe (prints a table).

Teacher-forced next-token prediction over the four real texts of `fp8_kv_accuracy.py` (Python's own docs and
source), one uncached forward per text (torch attention, float32, CPU): the top-1 at every position is compared
with the 16-bit model's. Recipes: weight scales per output channel or per 128 x 128 block (Qwen's FP8 checkpoints),
activation scales per token or per token and group of columns (`models/layers/fp8_linear.py`; a group is halved
until it divides K: SmolLM2's hidden size 576 takes 64), and weight-only rounding (activations unquantized) to
split the two error sources.

    python launch/bench/fp8_weights_accuracy.py          # 8 runs of 1-3 min each on 2 cores
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
from spmd_engine.models.layers.fp8_linear import WHOLE_ROW, Fp8Scheme, quantize_linear_layers

MARGIN = 0.5  # logits: "near a tie" below this top-1/top-2 margin of the 16-bit model

RECIPES = {
    "channel weights, token acts": Fp8Scheme(1, WHOLE_ROW, WHOLE_ROW, False),
    "channel weights, 128-col acts": Fp8Scheme(1, WHOLE_ROW, 128, False),
    "channel weights, 32-col acts": Fp8Scheme(1, WHOLE_ROW, 32, False),
    "128x128 weights, 128-col acts": Fp8Scheme(128, 128, 128, False),
    "128x128 weights, token acts": Fp8Scheme(128, 128, WHOLE_ROW, False),
}


def weight_only(model) -> None:
    """Activations left unquantized: each fp8 layer multiplies x by its dequantized weight."""
    from spmd_engine.kernels.reference import fp8_dequantize_weight_reference

    for module in model.modules():
        if getattr(module, "fp8_scheme", None) is not None:
            def matmul(x, bias, out_dtype=None, gated=False, m=module):
                if gated:
                    gate, up = x.chunk(2, dim=-1)
                    x = torch.nn.functional.silu(gate) * up
                w = fp8_dequantize_weight_reference(m.weight, m.weight_scale_inv, 1, m.fp8_block_k)
                y = x.float() @ w.t() + (bias.float() if bias is not None else 0)
                return y.to(out_dtype or x.dtype)
            module.matmul = matmul


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-text", type=int, default=512)
    parser.add_argument("--recipes", nargs="*", default=None, help="names of RECIPES (default: all)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from fp8_kv_accuracy import real_texts
    from fp8_kv_study import top1
    from spmd_engine.models.gguf import embedded_model_dir
    from spmd_engine.models.loader import load_safetensors_weights
    from spmd_engine.models.parallel import TensorParallel
    from spmd_engine.models.registry import build_model

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model_dir = embedded_model_dir()
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())

    def build(scheme: Fp8Scheme | None):
        model = build_model(hf_config, TensorParallel.single(), "torch", quantization="none")
        if scheme is not None:
            quantize_linear_layers(model, scheme)
            model.fp8_scheme = scheme
        load_safetensors_weights(model, model_dir)
        return model.eval()

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    seqs = [tokenizer.encode(text, add_special_tokens=False)[: args.tokens_per_text] for _, text in real_texts()]
    base, margin = top1(build(None), seqs)
    near = margin < MARGIN
    print(f"SmolLM2-135M-Instruct, float32, torch {torch.__version__}; {len(seqs)} texts x {args.tokens_per_text} "
          f"tokens, {base.numel()} positions, {near.float().mean().item():.1%} within {MARGIN} logits of a tie")
    print(f"\n{'recipe':<44} {'top-1 agree':>12} {'flips':>6} {f'agree, margin>={MARGIN}':>19}")
    names = args.recipes or list(RECIPES)
    runs = [(name, RECIPES[name], False) for name in names]
    runs.append(("channel weights, 128-col acts (weights only)", RECIPES["channel weights, 128-col acts"], True))
    runs.append(("128x128 weights (weights only)", RECIPES["128x128 weights, 128-col acts"], True))
    for name, scheme, only_weights in runs:
        started = time.perf_counter()
        model = build(scheme)
        if only_weights:
            weight_only(model)
        agree = top1(model, seqs)[0] == base
        print(f"{name:<44} {agree.float().mean().item():>12.2%} {int((~agree).sum()):>6} "
              f"{agree[~near].float().mean().item():>19.2%}   ({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
