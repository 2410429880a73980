"""GPU: the fused MoE experts (`kernels/fused_moe.py`, router top-k + slot grouping + two grouped GEMMs) at
Qwen3-30B-A3B's expert shape (128 experts of hidden 2048 x 768, 8 per token, bf16), against the torch
reference and against what the touched experts' bytes and FLOPs allow.

For each batch (tokens in the step) and routing skew (uniform; one-expert: every token's first choice is
one expert; few: 16 experts get every token, the rest are empty) it prints: µs per layer of the fused
path (CUDA graph replay over `--layers` weight copies, so weights come from HBM, not L2), the same for the
torch reference (eager, one copy: indicative only), the experts touched, GB/s of the touched experts'
weights, TFLOP/s of the routed work, and the fraction of the bandwidth floor (touched bytes / copy rate
measured here). A correctness check against the reference (relative error) comes with each row.

`--tp-sim` measures the two tensor-parallel splits on one GPU: for tp = 2, 4, 8 each rank's share is run
alone (moe_tp_split=experts: rank r's E/tp whole experts on the global routing; intermediate: all experts
with I/tp features), and the slowest rank's time is printed for each split: the step waits for it. The
default `moe_tp_split` follows this table.

`--sweep` times every grouped-GEMM tile (BLOCK_M, BLOCK_N, BLOCK_K) of a small grid per batch against the
default path (below SMALL_MOE_MAX_TOKENS the GEMV-style kernels): where to put that threshold and the tiles.

Run: `python launch/bench/bench_fused_moe.py [--batches 1 4 16 64 256 1024 4096] [--tp-sim] [--sweep]`
"""
from __future__ import annotations

import argparse

import torch

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
from spmd_engine.kernels.fused_moe import block_config, fused_moe
from spmd_engine.kernels.moe_route import moe_route
from spmd_engine.kernels.reference import fused_moe_reference

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8


def copy_rate(device: torch.device) -> float:
    """Device copy bandwidth, bytes read + written per second."""
    x = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    return 2 * (1 << 28) * 20 / (start.elapsed_time(end) / 1e3)


def logits_for(skew: str, tokens: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    logits = torch.randn(tokens, EXPERTS, generator=gen)
    if skew == "one-expert":
        logits[:, 3] += 100.0
    elif skew == "few":
        logits[:, 16:] -= 100.0
    return logits.to(device)


def graph_us(fn, reps: int = 20) -> float:
    """µs per call of `fn` replayed in a CUDA graph (warmed up on a side stream first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def layer_us(xs, w13s, w2s, weights, ids, first_expert: int = 0, config=None) -> float:
    """µs per layer: the fused experts over every weight copy in one graph, divided by the copies."""
    def run():
        for w13, w2 in zip(w13s, w2s):
            fused_moe(xs, w13, w2, weights, ids, first_expert, config=config)
    return graph_us(run) / len(w13s)


SWEEP = [(m, n, k) for m in (16, 32, 64) for n in (32, 64, 128) for k in (64, 128)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256, 1024, 4096])
    parser.add_argument("--layers", type=int, default=4, help="weight copies per graph (4 x 1.2 GB: past L2)")
    parser.add_argument("--tp-sim", action="store_true", help="time each rank's share of tp = 2, 4, 8")
    parser.add_argument("--sweep", action="store_true", help="time every tile choice per batch (uniform routing)")
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    w13s = [(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.02).to(device, torch.bfloat16)
            for _ in range(args.layers)]
    w2s = [(torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.02).to(device, torch.bfloat16)
           for _ in range(args.layers)]
    rate = copy_rate(device)
    expert_bytes = 3 * HIDDEN * INTER * 2
    print(f"copy rate {rate / 1e12:.2f} TB/s; one expert {expert_bytes / 1e6:.2f} MB")
    print(f"{'tokens':>6} {'skew':>10} {'fused us':>9} {'ref us':>9} {'touched':>7} {'GB/s':>7} {'TFLOP/s':>8} "
          f"{'of floor':>8} {'rel err':>8}")
    for tokens in args.batches:
        for skew in ("uniform", "one-expert", "few"):
            x = (torch.randn(tokens, HIDDEN, generator=gen)).to(device, torch.bfloat16)
            weights, ids = moe_route(logits_for(skew, tokens, gen, device), TOP_K, True)
            touched = int(torch.unique(ids).numel())
            fused = layer_us(x, w13s, w2s, weights, ids)
            out = fused_moe(x, w13s[0], w2s[0], weights, ids).float()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            ref = fused_moe_reference(x, w13s[0], w2s[0], weights, ids).float()
            end.record()
            torch.cuda.synchronize()
            ref_us = start.elapsed_time(end) * 1e3
            err = float((out - ref).norm() / ref.norm())
            floor_us = touched * expert_bytes / (rate / 2) * 1e6  # weights are read once: half the copy traffic
            flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
            print(f"{tokens:>6} {skew:>10} {fused:>9.1f} {ref_us:>9.1f} {touched:>7} "
                  f"{touched * expert_bytes / fused / 1e3:>7.0f} {flops / fused / 1e6:>8.1f} "
                  f"{floor_us / fused:>8.2f} {err:>8.1e}")
    if args.sweep:
        print("\ntile sweep, uniform routing: µs per layer of the default path (the GEMV-style kernels up to "
              "SMALL_MOE_MAX_TOKENS tokens, else block_config's tiles) and of the best grouped tiles")
        for tokens in args.batches:
            x = torch.randn(tokens, HIDDEN, generator=gen).to(device, torch.bfloat16)
            weights, ids = moe_route(logits_for("uniform", tokens, gen, device), TOP_K, True)
            times = {c: layer_us(x, w13s, w2s, weights, ids, config=c) for c in SWEEP}
            best = min(times, key=times.get)
            print(f"{tokens:>6}: default (block_config {block_config(tokens * TOP_K, EXPERTS)}) "
                  f"{layer_us(x, w13s, w2s, weights, ids):.1f} us; best grouped {best} {times[best]:.1f} us")
    if args.tp_sim:
        print("\nslowest rank's µs per layer (uniform routing)")
        print(f"{'tokens':>6} {'tp':>3} {'experts':>9} {'intermediate':>12}")
        for tokens in args.batches:
            x = torch.randn(tokens, HIDDEN, generator=gen).to(device, torch.bfloat16)
            weights, ids = moe_route(logits_for("uniform", tokens, gen, device), TOP_K, True)
            for tp in (2, 4, 8):
                per = EXPERTS // tp
                by_experts = max(layer_us(x, [w[r * per:(r + 1) * per] for w in w13s],
                                          [w[r * per:(r + 1) * per] for w in w2s], weights, ids, r * per)
                                 for r in range(tp))
                inter = INTER // tp
                w13_part = [torch.cat([w[:, :inter], w[:, INTER:INTER + inter]], dim=1).contiguous() for w in w13s]
                w2_part = [w[:, :, :inter].contiguous() for w in w2s]
                by_inter = layer_us(x, w13_part, w2_part, weights, ids)
                print(f"{tokens:>6} {tp:>3} {by_experts:>9.1f} {by_inter:>12.1f}")
                del w13_part, w2_part


if __name__ == "__main__":
    main()
