"""GPU A/B of Programmatic Dependent Launch (`kernels/pdl.py`, engine key `cuda_pdl`) on a decode step.

Why: at batch 1 a Qwen3-0.6B decode step is ~230 small dependent kernels replayed from one CUDA graph;
the gaps between them (launch, CTA dispatch, ramp) are a large share of the inter-token latency. PDL
lets each kernel's launch overlap its predecessor's tail; this measures what that saves.

The step (tests/helpers/decode_step.py, shared with tests/gpu/test_pdl.py) is built from the engine's own
kernel functions, Qwen3-0.6B-shaped, each of its 28 layers with its own weights and paged KV cache.

For each batch the step is captured in one CUDA graph with PDL off and again with it on, the replays
timed (median, rounds alternating off/on), and the logits of the two graphs compared bit for bit
(they must be equal: every kernel waits for its predecessor before touching memory).
Run: `python launch/bench/bench_pdl.py [--batch 1 256] [--context 256] [--rounds 3]`.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import triton

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
from bench_fused_ops import graph_ms
from spmd_engine.kernels.pdl import GDC_AVAILABLE, pdl_supported, set_pdl
from tests.helpers.decode_step import LAYERS, DecodeStep


def timed(step: DecodeStep, on: bool) -> tuple[float, torch.Tensor]:
    """(median ms per graph replay, the replay's logits) with PDL on or off for the capture."""
    set_pdl(on)
    try:
        ms = graph_ms(step.run)  # warm-up (compiles this PDL setting's kernels), capture, timed replays
    finally:
        set_pdl(False)
    torch.cuda.synchronize()
    return ms, step.logits.clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 256], help="decode rows per step")
    parser.add_argument("--context", type=int, default=256, help="tokens per sequence (the new one included)")
    parser.add_argument("--rounds", type=int, default=3, help="off/on timings per batch (medians reported)")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          "CUDA", torch.version.cuda)
    if not pdl_supported(device):
        print(f"PDL cannot run here (compute capability {torch.cuda.get_device_capability()}, "
              f"gdc in Triton: {GDC_AVAILABLE}): nothing to compare")
        return
    print(f"Qwen3-0.6B-shaped decode step, {LAYERS} layers, context {args.context}, one CUDA graph per setting")
    print(f"{'batch':>6} {'PDL off ms':>11} {'PDL on ms':>10} {'saved us':>9} {'saved %':>8} {'same bits':>9}  rounds")
    with torch.inference_mode():
        for batch in args.batch:
            step = DecodeStep(batch, args.context)
            off, on, same = [], [], True
            reference = None
            for _ in range(args.rounds):
                t_off, logits_off = timed(step, False)
                t_on, logits_on = timed(step, True)
                off.append(t_off)
                on.append(t_on)
                reference = logits_off if reference is None else reference
                same &= torch.equal(logits_off, reference) and torch.equal(logits_on, reference)
            t_off, t_on = statistics.median(off), statistics.median(on)
            rounds = " ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(off, on))
            print(f"{batch:>6} {t_off:>11.3f} {t_on:>10.3f} {1000 * (t_off - t_on):>9.1f} "
                  f"{100 * (t_off - t_on) / t_off:>7.1f}% {'yes' if same else 'NO':>9}  {rounds}")
            del step
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
