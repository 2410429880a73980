"""How far a benchmark run is from the GPU's physical limit (the bandwidth/compute floor).

floor = (weights read once per decode step (the longest output's length) + every running sequence's KV read each decode step) /
measured copy bandwidth + prefill FLOPs / measured matmul rate, all per rank.
"""
from __future__ import annotations

import time

import torch


def measure_device_rates(device: torch.device) -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s, measured now."""
    if device.type != "cuda":
        return {}
    x = torch.empty(1 << 29, dtype=torch.uint8, device=device)  # 512 MiB
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)

    def timed(fn, reps: int) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    copy_s = timed(lambda: y.copy_(x), 20)
    mm_s = timed(lambda: a @ b, 10)
    del x, y, a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * (1 << 29) / copy_s, "matmul_flop_per_s": 2 * 8192**3 / mm_s}


def bench_report(llm, outputs, wall_s: float) -> dict:
    shape, tp = llm.shape, llm.ranks.world_size
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    kv_bytes_per_token = llm.runner.spec.bytes_per_block // llm.cfg.block_size
    ok = [o for o in outputs if o.finish_reason != "error"]
    kv_bytes = 0
    prefill_flops = 0.0
    matmul_params = weight_bytes / llm.dtype.itemsize - shape.vocab_size * shape.hidden_size / tp  # no embedding
    for o in ok:
        p, n = len(o.prompt_token_ids), len(o.token_ids)
        kv_bytes += kv_bytes_per_token * (n * p + n * (n - 1) // 2)  # context p .. p+n-1 per decode step
        attn = 2 * 2 * shape.num_layers * (shape.num_heads // tp) * shape.head_dim * p * p / 2
        prefill_flops += 2 * matmul_params * p + attn
    # the fewest decode steps any schedule needs: the longest output, every sequence decoding together
    decode_steps = max((len(o.token_ids) for o in ok), default=0)
    report = {"weight_bytes_per_rank": weight_bytes, "kv_bytes_read": kv_bytes, "prefill_flops": prefill_flops,
              "min_decode_steps": decode_steps, **llm.last_run}
    rates = measure_device_rates(llm.device)
    if rates:
        floor = (weight_bytes * decode_steps + kv_bytes) / rates["copy_bytes_per_s"] \
            + prefill_flops / rates["matmul_flop_per_s"]
        report.update(rates)
        report["floor_s"] = floor
        report["fraction_of_floor"] = floor / wall_s if wall_s > 0 else 0.0
    return report
