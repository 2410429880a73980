"""How far a benchmark run is from the GPU's physical limit (the bandwidth/compute floor).

floor = (matmul + LM-head weights read once per decode step (the longest output's length - 1) + every
sequence's KV context read at each of its decode steps) / measured copy bandwidth + prefill FLOPs /
measured matmul rate, all per rank; with data-parallel replicas, the largest replica's floor.

MoE layers add the bytes of the experts a decode step touches: with B sequences in the step (all decoding
together, fewer as outputs end) each layer touches, in expectation under uniform routing, E_local x
(1 - (1 - k/E)^B) of its rank's experts (k per token at batch 1: the active parameters); their prefill FLOPs
count the k experts per token only.
"""
from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger(__name__)


def measure_device_rates(device: torch.device) -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s, measured now."""
    if device.type != "cuda":
        return {}
    torch.cuda.empty_cache()  # reuse the step loop's cached blocks instead of growing the reservation
    x = torch.empty(1 << 28, dtype=torch.uint8, device=device)  # 256 MiB: well past the 60 MB L2
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
    x = y = a = b = None  # the 1.5 GiB go back before the next job's allocations
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * (1 << 28) / copy_s, "matmul_flop_per_s": 2 * 8192**3 / mm_s}


def _keys_read(p: int, n: int, window: int) -> int:
    """Keys one layer reads over decode steps 1 .. n-1 of a p-token prompt: p + j at step j, at most `window`."""
    full = (n - 1) * p + n * (n - 1) // 2
    if not window or p + n - 1 <= window:
        return full
    below = max(0, min(n - 1, window - p))  # steps whose context still fits the window
    return below * p + below * (below + 1) // 2 + (n - 1 - below) * window


def _prefill_pairs(p: int, window: int) -> float:
    """Query-key pairs of one layer's prefill of p tokens (p^2 / 2 as the floor counts; a window caps a row)."""
    if not window or p <= window:
        return p * p / 2
    return window * window / 2 + (p - window) * window


def bench_work(llm, outputs) -> dict:
    """What one replica's requests need at the least, per rank (the floor's terms, before any rate)."""
    shape, tp = llm.shape, llm.replica.tp_size
    kv_bytes_per_token = llm.runner.spec.bytes_per_block // llm.cfg.block_size
    weights = _weight_bytes(llm.model)
    ok = [o for o in outputs if o.finish_reason != "error"]
    kv_bytes = 0
    prefill_flops = 0.0
    matmul_params = weights["matmul_params"]  # fp8 weights: 1 byte each, their scales counted in the bytes only
    head_params = weights["lm_head"] / llm.dtype.itemsize
    windows = list(shape.layer_windows) or [0] * shape.num_layers  # a sliding layer reads its window only
    for o in ok:
        p, n = len(o.prompt_token_ids), len(o.token_ids)
        # decode step j (1 .. n-1) reads the p + j cached keys of its context (at most a sliding layer's window)
        keys_read = sum(_keys_read(p, n, w) for w in windows) / len(windows)
        kv_bytes += int(kv_bytes_per_token * keys_read) if n > 0 else 0
        if o.sample_index:  # a later completion of an n-sample request: its prompt is prefilled once
            continue
        pairs = sum(_prefill_pairs(p, w) for w in windows)  # over the layers: query-key pairs each computes
        attn = 2 * 2 * (shape.num_heads // tp) * shape.head_dim * pairs
        prefill_flops += 2 * matmul_params * p + 2 * head_params + attn  # LM head: the last token only
    # the fewest decode steps any schedule needs: the longest output, every sequence decoding together
    decode_steps = max((len(o.token_ids) - 1 for o in ok), default=0)
    weight_bytes = weights["matmul"] + weights["lm_head"]  # what one decode step reads (not the embedding)
    work = {"weight_bytes_per_rank": weight_bytes, "kv_bytes_read": kv_bytes, "prefill_flops": prefill_flops,
            "min_decode_steps": decode_steps}
    blocks = _moe_blocks(llm.model)
    if blocks:
        # decode step j runs every sequence whose output is still growing: those with more than j + 1 tokens
        lengths = sorted(len(o.token_ids) for o in ok)
        batches = [sum(1 for n in lengths if n - 1 > j) for j in range(decode_steps)]
        work["expert_bytes_read"] = sum(b.touched_bytes(batch) for b in blocks for batch in batches)
        work["batch1_expert_bytes"] = sum(b.touched_bytes(1) for b in blocks)
        work["prefill_flops"] += 2 * sum(b.active_params_per_token() for b in blocks) * sum(
            len(o.prompt_token_ids) for o in ok if not o.sample_index)
    return work


def _moe_blocks(model: torch.nn.Module) -> list:
    """The model's MoE blocks (they tell the bytes of the experts a step touches)."""
    return [m for m in model.modules() if hasattr(m, "touched_bytes") and hasattr(m, "active_params_per_token")]


def _floor_s(work: dict, rates: dict) -> float:
    return (work["weight_bytes_per_rank"] * work["min_decode_steps"] + work["kv_bytes_read"]
            + work.get("expert_bytes_read", 0)) / rates["copy_bytes_per_s"] \
        + work["prefill_flops"] / rates["matmul_flop_per_s"]


def bench_report(llm, works: list[dict], engine_run: dict, wall_s: float, output_tokens: int,
                 world_size: int) -> dict:
    """The floor of this run, its measured fraction, the job's throughput and step timing.

    `works`: each data-parallel replica's `bench_work`, in replica order; `engine_run`: metrics.json's
    `engine` (the replicas' steps merged). Replicas run side by side, so the job's floor is the largest
    replica floor; output tok/s is the whole job's output tokens over the wall time, and per GPU that
    over the world size (every rank is one GPU)."""
    report: dict = dict(works[0]) if len(works) == 1 else {
        "weight_bytes_per_rank": works[0]["weight_bytes_per_rank"],
        "kv_bytes_read": sum(w["kv_bytes_read"] for w in works),
        "prefill_flops": sum(w["prefill_flops"] for w in works),
        "min_decode_steps": max(w["min_decode_steps"] for w in works),
        **({"expert_bytes_read": sum(w.get("expert_bytes_read", 0) for w in works)}
           if "expert_bytes_read" in works[0] else {}),
        "per_replica": [{"replica": r, **w} for r, w in enumerate(works)]}
    per_s = output_tokens / wall_s if wall_s > 0 else 0.0
    report.update({"world_size": world_size, "output_tokens_per_s": per_s,
                   "output_tokens_per_s_per_gpu": per_s / world_size})
    report.update({k: v for k, v in engine_run.items() if k != "per_replica"})
    log.info("bench: %d output tokens in %.2f s: %.1f tok/s, %.1f per GPU (%d GPUs)", output_tokens, wall_s,
             per_s, per_s / world_size, world_size)
    rates = measure_device_rates(llm.device)
    if rates:
        floors = [_floor_s(w, rates) for w in works]
        floor = max(floors)
        if len(works) > 1:
            for row, replica_floor in zip(report["per_replica"], floors):
                row["floor_s"] = replica_floor
        report.update(rates)
        report["floor_s"] = floor
        report["fraction_of_floor"] = floor / wall_s if wall_s > 0 else 0.0
        # one decode step at batch 1 (no KV): the ITL floor of a single sequence
        report["batch1_step_floor_ms"] = 1e3 * (works[0]["weight_bytes_per_rank"]
                                                + works[0].get("batch1_expert_bytes", 0)) / rates["copy_bytes_per_s"]
        log.info("bench: a batch-1 decode step's floor is %.3f ms (weights it reads, no KV)",
                 report["batch1_step_floor_ms"])
        log.info("bench: %.3f s wall vs %.3f s floor (%.1f%% of the floor; copy %.2f TB/s, matmul %.0f TFLOP/s)",
                 wall_s, floor, 100 * report["fraction_of_floor"], rates["copy_bytes_per_s"] / 1e12,
                 rates["matmul_flop_per_s"] / 1e12)
    timing = engine_run.get("step_timing", {})
    for kind in ("decode_max_batch", "decode", "mixed", "prefill"):
        row = timing.get(kind)
        if row:
            idle = (f"; GPU idle {row['gpu_idle_ms']:.3f} ms ({100 * row['gpu_idle_fraction']:.1f}%)"
                    if "gpu_idle_ms" in row else "")
            idle += f"; GPU busy {row['gpu_busy_ms']:.3f} ms" if "gpu_busy_ms" in row else ""
            log.info("bench %s steps: %d x %.2f ms (%.0f seqs): wait %.3f, postprocess %.3f, schedule %.3f, "
                     "broadcast %.3f, inputs %.3f, sample %.3f, forward %.3f ms; host plan work %.1f%%%s", kind,
                     row["steps"], row["step_ms"], row["mean_seqs"], row["wait_ms"], row["postprocess_ms"],
                     row["schedule_ms"], row["broadcast_ms"], row["inputs_ms"], row["sample_ms"], row["forward_ms"],
                     100 * row["host_plan_fraction"], idle)
            if "launches" in row:
                log.info("bench %s steps by launch: %s", kind,
                         ", ".join(f"{k} {n}" for k, n in row["launches"].items()))
    return report


def _weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes per rank of the matmul weights in the layers, of the LM head, and of the embedding
    (a tied LM head is the embedding: counted as the LM head, since decoding reads all of it)."""
    out = {"matmul": 0, "lm_head": 0, "embedding": 0, "other": 0, "matmul_params": 0}
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        size = param.numel() * param.element_size()
        if name.startswith("lm_head.") or (name.endswith("embed_tokens.weight") and _is_tied(model, param)):
            out["lm_head"] += size
        elif "embed_tokens" in name:
            out["embedding"] += size
        elif param.dim() == 2:
            out["matmul"] += size
            if not name.endswith("weight_scale_inv"):
                out["matmul_params"] += param.numel()
        else:
            out["other"] += size  # norms, biases
    return out


def _is_tied(model: torch.nn.Module, param: torch.nn.Parameter) -> bool:
    head = getattr(model, "lm_head", None)
    return head is not None and head.weight is param
