"""`LLM.update_weights` from host tensors, end to end, and a sleep / wake-up round trip (GPU; CPU for a smoke run).

Why: an RL loop hands the engine a full checkpoint of (HF name, tensor) pairs after every training step; the
issue's target is Qwen3-8B from pinned host bf16 tensors in at most 2 s. This builds the engine at the
checkpoint's shape with dummy weights, makes two host checkpoints X and Y (every HF name, pinned on CUDA,
bf16 by default), times `update_weights(X)` (`--repeats` times, then the median), and checks it:

- a few parameters equal their source's rows (q/k/v packed, gate/up packed, row-parallel, embedding, head);
- greedy outputs after X, then Y, then X again: X's twice the same, Y's not (a tensor the update missed
  would keep Y's values). tests/spmd_engine/test_update_weights.py checks on CPU that they equal a fresh engine's.

Then `sleep(level)` / `wake_up()` timed, the CUDA graphs captured again if an address moved, and the greedy
outputs compared with X's.

    python launch/bench/bench_update_weights.py                       # Qwen3-8B shape (conf/model/qwen3_8b.yaml)
    python launch/bench/bench_update_weights.py --pageable            # host tensors not pinned
    python launch/bench/bench_update_weights.py --model CKPT_DIR --device cpu   # a smoke run at CKPT's shape
"""
from __future__ import annotations

import argparse
import statistics
import time

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)

PROMPTS = [{"prompt_token_ids": [100 + 7 * i + j for j in range(24 + 5 * i)]} for i in range(4)]


def host_checkpoint(shapes: dict[str, tuple[int, ...]], seed: int, dtype, device, pinned: bool) -> dict:
    """Random tensors of every checkpoint shape, drawn on `device` (fast) and kept on the host: norms ~1, the
    rest ~N(0, 0.02), like the dummy loader."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        drawn = torch.randn(shapes[name], generator=generator, device=device, dtype=torch.float32).mul_(0.02)
        if name.endswith("norm.weight"):
            drawn.add_(1.0)
        host = torch.empty(shapes[name], dtype=dtype, pin_memory=pinned)
        tensors[name] = host.copy_(drawn)
    return tensors


def greedy_ids(llm, max_tokens: int) -> list[list[int]]:
    from spmd_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]


def timed(fn, device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def source_rows_match(model, tensors: dict) -> list[str]:
    """Names of the checked tensors whose rows in the engine's parameters differ from the source (tp 1)."""
    import torch

    layer = model.model.layers[0]
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    q, kv, inter = qkv.q_size, qkv.kv_size, gate_up.sizes_per_rank[0]
    checks = {
        "model.layers.0.self_attn.q_proj.weight": qkv.weight[:q],
        "model.layers.0.self_attn.v_proj.weight": qkv.weight[q + kv:],
        "model.layers.0.mlp.up_proj.weight": gate_up.weight[inter:],
        "model.layers.0.mlp.down_proj.weight": layer.mlp.down_proj.weight,
        "model.layers.0.input_layernorm.weight": layer.input_layernorm.weight,
        "model.embed_tokens.weight": model.model.embed_tokens.weight,
        "lm_head.weight": model.lm_head.weight,
    }
    return [name for name, param in checks.items()
            if name in tensors and not torch.equal(param.cpu(), tensors[name].to(param.dtype))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3_8b", help="a conf/model group or a checkpoint dir (its shape)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--source-dtype", default="bfloat16", help="the host tensors' dtype (cast at the copy)")
    parser.add_argument("--pageable", action="store_true", help="host tensors in pageable memory, not pinned")
    parser.add_argument("--sleep-level", type=int, default=1, choices=(1, 2))
    args = parser.parse_args()

    import torch

    from spmd_engine import LLM

    keys = {"device": args.device, "max_model_len": 1024}
    if args.device == "cpu":
        keys.update(num_kv_blocks=128, block_size=16, max_model_len=256)
    llm = LLM(model=args.model, load_format="dummy", **keys)
    try:
        engine = llm.engine
        device, dtype = engine.device, getattr(torch, args.source_dtype)
        pinned = device.type == "cuda" and not args.pageable
        shapes = engine.model.checkpoint_shapes()
        started = time.perf_counter()
        x = host_checkpoint(shapes, 1, dtype, device, pinned)
        y = host_checkpoint(shapes, 2, dtype, device, pinned)
        gib = sum(t.numel() * t.element_size() for t in x.values()) / (1 << 30)
        print(f"{args.model}: {len(x)} tensors, {gib:.2f} GiB per checkpoint ({args.source_dtype}, "
              f"{'pinned' if pinned else 'pageable'} host memory), built in {time.perf_counter() - started:.1f} s; "
              f"engine {str(engine.dtype).replace('torch.', '')} on {device}")

        seconds = [timed(lambda: llm.update_weights(x.items()), device) for _ in range(args.repeats)]
        print(f"update_weights: median {statistics.median(seconds):.3f} s  ({', '.join(f'{s:.3f}' for s in seconds)}), "
              f"{gib / statistics.median(seconds):.1f} GiB/s")
        mismatched = source_rows_match(engine.model, x)
        print(f"parameters equal to their source rows: {'yes' if not mismatched else 'NO: ' + ', '.join(mismatched)}")

        outs_x = greedy_ids(llm, args.max_tokens)
        llm.update_weights(y.items())
        outs_y = greedy_ids(llm, args.max_tokens)
        llm.update_weights(x.items())
        outs_x_again = greedy_ids(llm, args.max_tokens)
        same, differs = outs_x_again == outs_x, outs_y != outs_x
        print(f"greedy outputs X -> Y -> X: X again equal {'yes' if same else 'NO'}, "
              f"Y differs {'yes' if differs else 'NO'}")

        asleep = timed(lambda: llm.sleep(args.sleep_level), device)
        free = torch.cuda.mem_get_info(device)[0] / (1 << 30) if device.type == "cuda" else float("nan")
        awake = timed(llm.wake_up, device)
        after_wake = greedy_ids(llm, args.max_tokens)
        print(f"sleep(level={args.sleep_level}) {asleep:.3f} s ({free:.1f} GiB free while asleep), "
              f"wake_up {awake:.3f} s, greedy outputs after it equal {'yes' if after_wake == outs_x else 'NO'}")
        ok = not mismatched and same and differs and after_wake == outs_x
        print("check:", "ok" if ok else "FAILED")
    finally:
        llm.close()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
