"""GPU benchmark of the paged attention kernels at Qwen3-0.6B attention shape (prints a table).

Decode is bandwidth-bound (reported as achieved GB/s over the K/V bytes it must read); prefill is
compute-bound (reported as TFLOP/s over the causal QK^T and PV products). Every row also shows the
relative error against `kernels/reference.py`. Run: `python launch/bench/bench_attention.py`
(`--sweep` additionally times a grid of tile configs to pick the defaults; `--splits` times only batch-1
decode by split count, the basis of MIN_TOKENS_PER_SPLIT; `--kv-fp8` stores the caches
as float8 e4m3 with per-KV-head scales, the `kv_cache_dtype=fp8` path: GB/s then counts 1-byte K/V, and
`decode-cuda` rows time the CUDA kernel of `cuda_fp8_decode` beside the Triton one).
The `merge` rows time the decode's split merge both ways, replayed in a CUDA graph as the engine runs
it: fused into the split kernel (the last split to arrive merges; what the engine runs), or by the tests'
second-launch oracle (tests/helpers/split_oracles.py), and check their bits are equal.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import math
import time
from functools import lru_cache

import torch
import triton.testing

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
from spmd_engine.kernels.decode_attention import (
    DecodeConfig,
    default_decode_config,
    paged_decode_attention,
    split_count,
)
import spmd_engine.kernels.decode_attention_fp8_cuda as fp8_cuda
from spmd_engine.kernels.kv_quant import FP8_DTYPE
from spmd_engine.kernels.kv_store import store_kv
from spmd_engine.kernels.mixed_attention import plan_paged_attention
from spmd_engine.kernels.pdl import pdl_launches
from spmd_engine.kernels.prefill_attention import PrefillConfig, default_prefill_config, paged_prefill_attention
from spmd_engine.kernels.reference import paged_attention_reference
from tests.helpers.split_oracles import second_launch_reductions

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE = 16, 8, 128, torch.bfloat16  # Qwen3-0.6B
KV_FP8 = False  # --kv-fp8: float8_e4m3fn caches with per-KV-head scales


@lru_cache(maxsize=4)
def paged_inputs(query_len: int | tuple[int, ...], seq_lens: tuple[int, ...], block_size: int, seed: int = 0):
    """Random bf16 query and caches, each sequence's blocks scattered by a random permutation; query_len
    is every sequence's new tokens (at most its seq_len), or one per sequence."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks)
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen)
    v_cache = torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen)
    if KV_FP8:
        k_cache, v_cache = k_cache.to(FP8_DTYPE), v_cache.to(FP8_DTYPE)
    order = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = order[used : used + n]
        used += n
    per_seq = query_len if isinstance(query_len, tuple) else (query_len,) * len(seq_lens)
    q_lens = [min(n, s) for n, s in zip(per_seq, seq_lens)]
    cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device="cuda")
    query = torch.randn(int(cu[-1]), NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return query, k_cache, v_cache, cu, lens, tables


def kv_scales() -> dict[str, torch.Tensor | None]:
    """The k_scale/v_scale keyword arguments: per-KV-head powers of two with an fp8 cache, else none."""
    if not KV_FP8:
        return {"k_scale": None, "v_scale": None}
    scale = torch.exp2(-(torch.arange(NUM_KV_HEADS, device="cuda", dtype=torch.float32) % 4))
    return {"k_scale": scale / 8, "v_scale": scale}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def median_ms(fn, rep: int = 200) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def copy_bandwidth_gbs() -> float:
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def bench_decode(batch: int, context: int, block_size: int, config: DecodeConfig | None = None,
                 cuda_kernel: bool = False):
    """`cuda_kernel`: the fp8 cache's CUDA kernel (kernels/decode_attention_fp8_cuda.py) instead of Triton's."""
    q, kc, vc, cu, lens, tables = paged_inputs(1, (context,) * batch, block_size)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)
    scales = kv_scales()
    if cuda_kernel:
        config = fp8_cuda.decode_config()
        run = lambda: fp8_cuda.paged_decode_attention_fp8(q, kc, vc, lens, tables, scale, out=out, **scales)  # noqa: E731
    else:
        run = lambda: paged_decode_attention(q, kc, vc, lens, tables, scale, out=out, config=config, **scales)  # noqa: E731
    run()
    checked = config is None or cuda_kernel
    err = rel_error(out, paged_attention_reference(q, kc, vc, cu, lens, tables, scale, **scales)) if checked else 0.0
    ms = median_ms(run, rep=200 if checked else 60)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * kc.element_size()
    io_bytes = 2 * q.numel() * q.element_size() + tables.numel() * 4
    cfg = config or default_decode_config(HEAD_DIM, q.device, KV_FP8)
    splits = split_count("bench_attention", None, batch, kc, tables, cfg)
    return ms, (kv_bytes + io_bytes) / ms / 1e6, err, splits


def bench_decode_merge(batch: int, context: int, block_size: int) -> tuple[float, float, bool, int]:
    """(two-launch us, fused us, same bits, splits): the engine's fused merge and the tests' second-launch
    merge of the split partials, each timed as CUDA-graph replays (no host launch gaps, as in the engine's
    decode graphs)."""
    q, kc, vc, _, lens, tables = paged_inputs(1, (context,) * batch, block_size)
    scale, scales = HEAD_DIM**-0.5, kv_scales()
    outs = {fused: torch.empty_like(q) for fused in (False, True)}
    times = {}
    for fused, out in outs.items():
        attend = functools.partial(paged_decode_attention, q, kc, vc, lens, tables, scale, out=out, **scales)

        def run(attend=attend, fused=fused):
            with contextlib.nullcontext() if fused else second_launch_reductions():
                attend()

        run()  # compile, allocate the merge counters outside the capture
        times[fused] = triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median") * 1e3
    splits = split_count("bench_attention", None, batch, kc, tables, default_decode_config(HEAD_DIM, q.device, KV_FP8))
    return times[False], times[True], torch.equal(outs[False], outs[True]), splits


def bench_prefill(batch: int, length: int, block_size: int, config: PrefillConfig | None = None):
    q, kc, vc, cu, lens, tables = paged_inputs(length, (length,) * batch, block_size)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)
    scales = kv_scales()
    run = lambda: paged_prefill_attention(q, kc, vc, cu, lens, tables, scale, length, out=out, config=config,  # noqa: E731
                                          **scales)
    run()
    err = (rel_error(out, paged_attention_reference(q, kc, vc, cu, lens, tables, scale, **scales))
           if config is None else 0.0)
    ms = median_ms(run, rep=200 if config is None else 60)
    flops = 4 * batch * NUM_Q_HEADS * HEAD_DIM * length * (length + 1) / 2  # causal pairs
    return ms, flops / ms / 1e9, err


def host_us(fn, calls: int = 200) -> float:
    """Host time per call of `fn` launched back to back without a sync (what a mixed step's eager
    attention costs the CPU per layer); the queue is drained before and after."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - started) / calls * 1e6
    torch.cuda.synchronize()
    return host


def bench_mixed(num_decodes: int, context: int, num_prompts: int, prompt_len: int, block_size: int,
                layers: int = 28):
    """A mixed step (issue #15): decodes first, then prompt chunks, at one layer's attention. Three ways:
    `two`: the decode kernel on the decode rows + the prefill kernel on the chunks, each call validating
    and planning itself (the path before the per-step plan); `plan`: the step's plan (built once per
    step, amortised over `layers` layers) and its one launch, what the engine runs; `prefill`: every row
    through the prefill kernel.
    Returns {way: (host us per call without sync, GPU us)} and the plan's rel error."""
    q_lens = (1,) * num_decodes + (prompt_len,) * num_prompts
    q, kc, vc, cu, lens, tables = paged_inputs(q_lens, (context,) * (num_decodes + num_prompts), block_size)
    scale, scales, out = HEAD_DIM**-0.5, kv_scales(), torch.empty_like(q)
    d = num_decodes
    rest = (cu[d:].clone(), lens[d:].clone(), tables[d:])  # sliced once per step, as the engine did

    def two():
        paged_decode_attention(q[:d], kc, vc, lens[:d], tables[:d], scale, out=out[:d], **scales)
        paged_prefill_attention(q, kc, vc, *rest, scale, prompt_len, out=out, **scales)

    def plan_for_step():
        return plan_paged_attention(q, kc, vc, out, cu, lens, tables, d, prompt_len, **scales)

    step_plan = plan_for_step()

    def planned():
        step_plan.launch(q, kc, vc, out, scale, **scales)

    def whole():
        paged_prefill_attention(q, kc, vc, cu, lens, tables, scale, prompt_len, out=out, **scales)

    planned()
    err = rel_error(out, paged_attention_reference(q, kc, vc, cu, lens, tables, scale, **scales))
    expected = out.clone()
    two()
    assert torch.equal(out, expected), "the plan's launch differs from the two-kernel path"
    plan_us = host_us(plan_for_step, 50) / layers  # the first layer's planning, spread over the step
    return {"two": (host_us(two), median_ms(two) * 1e3), "plan": (host_us(planned) + plan_us, median_ms(planned) * 1e3),
            "prefill": (host_us(whole), median_ms(whole) * 1e3)}, err


def bench_sdpa_prefill(batch: int, length: int) -> float:
    """torch's fused causal SDPA on contiguous (unpaged) tensors, as a reference point."""
    q = torch.randn(batch, NUM_Q_HEADS, length, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(batch, NUM_KV_HEADS, length, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    ms = median_ms(fn)
    return 4 * batch * NUM_Q_HEADS * HEAD_DIM * length * (length + 1) / 2 / ms / 1e9


def bench_store(tokens: int, block_size: int):
    gen = torch.Generator(device="cuda").manual_seed(1)
    key = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    value = torch.randn_like(key)
    num_blocks = math.ceil(tokens / block_size)
    k_cache = torch.empty(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, device="cuda",
                          dtype=FP8_DTYPE if KV_FP8 else DTYPE)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=gen)[:tokens]
    scales = kv_scales()
    ms = median_ms(lambda: store_kv(key, value, k_cache, v_cache, slots, scales["k_scale"], scales["v_scale"]))
    return ms, 2 * key.numel() * (key.element_size() + k_cache.element_size()) / ms / 1e6


def bench_batch1_splits(context: int, layers: int = 28, width_blocks: int = 256, block_size: int = 16,
                        splits: tuple[int, ...] = (32, 16, 8, 4, 2, 1)) -> tuple[dict[int, float], int]:
    """Batch-1 decode attention, µs per layer by split count: `layers` layers' caches (more bytes than the
    L2 holds at long contexts) attended one after another inside one CUDA graph, a `width_blocks`-wide
    block table (the engine's decode graphs are as wide as max_model_len), launched as the engine's
    batch-1 graphs are (with PDL where the device has it). Also returns the split count the rule picks."""
    gen = torch.Generator(device="cuda").manual_seed(context)
    shape = (width_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen),
               torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen)) for _ in range(layers)]
    q = torch.randn(1, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    out = torch.empty_like(q)
    lens = torch.tensor([context], dtype=torch.int32, device="cuda")
    table = torch.randperm(width_blocks, device="cuda", generator=gen).to(torch.int32).view(1, width_blocks)
    times = {}
    with pdl_launches(True):
        for count in splits:
            def run(count=count):
                for k_cache, v_cache in caches:
                    paged_decode_attention(q, k_cache, v_cache, lens, table, HEAD_DIM**-0.5, out=out,
                                           num_splits=count)
            run()  # compile, allocate the merge counters outside the capture
            times[count] = triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median") * 1e3 / layers
    cfg = default_decode_config(HEAD_DIM, q.device, KV_FP8)
    return times, split_count("bench_attention", None, 1, caches[0][0], table, cfg)


def sweep() -> None:
    print("\n# decode config sweep (ms)")
    configs = [
        DecodeConfig(block_n=n, num_warps=w, num_stages=s, programs_per_sm=4)
        for n, w, s in itertools.product((32, 64, 128), (4, 8), (1, 2, 3))
    ] + [DecodeConfig(block_n=64, num_warps=4, num_stages=2, programs_per_sm=p) for p in (1, 2, 8, 16)]
    shapes = [(256, 2048, 16), (64, 2048, 16), (1, 2048, 16)]
    print("config".ljust(72) + "".join(f"B{b}xL{c}/bs{s}".rjust(16) for b, c, s in shapes))
    for cfg in configs:
        try:
            row = [bench_decode(b, c, s, cfg)[0] for b, c, s in shapes]
            print(str(cfg).ljust(72) + "".join(f"{ms:16.4f}" for ms in row), flush=True)
        except Exception as exc:  # a config that does not compile (shared memory) is skipped
            print(str(cfg).ljust(72) + f"  failed: {type(exc).__name__}")
    print("\n# prefill config sweep (TFLOP/s, 16x1024, block_size 16)")
    grid = list(itertools.product((64, 128), (32, 64), (4, 8), (2, 3))) + [(128, 128, 8, 2)]
    for m, n, w, s in grid:
        cfg = PrefillConfig(block_m=m, block_n=n, num_warps=w, num_stages=s)
        try:
            tflops = bench_prefill(16, 1024, 16, cfg)[1]
            print(str(cfg).ljust(72) + f"{tflops:10.1f}", flush=True)
        except Exception as exc:
            print(str(cfg).ljust(72) + f"  failed: {type(exc).__name__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tile configs")
    parser.add_argument("--kv-fp8", action="store_true", help="float8 e4m3 K/V caches (kv_cache_dtype=fp8)")
    parser.add_argument("--splits", action="store_true",
                        help="only the batch-1 table: decode µs per layer by split count (MIN_TOKENS_PER_SPLIT)")
    args = parser.parse_args()
    global KV_FP8
    KV_FP8 = args.kv_fp8
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA GPU")
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"# shape: Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} {DTYPE}, KV cache "
          f"{'float8_e4m3fn' if KV_FP8 else DTYPE}")
    print(f"# decode config {default_decode_config(HEAD_DIM, device, KV_FP8)}")
    print(f"# prefill config {default_prefill_config(HEAD_DIM, device)}")
    if args.splits:
        print("\n# batch 1, 28 layers in one CUDA graph, 4096-token table, block 16: us per layer by split count")
        for context in (650, 2000, 4000):
            times, chosen = bench_batch1_splits(context)
            print(f"context {context:5d}: " + "  ".join(f"{n} splits {us:6.2f}" for n, us in times.items())
                  + f"   (the rule picks {chosen})", flush=True)
        return
    print(f"# device-to-device copy: {copy_bandwidth_gbs():.0f} GB/s (read + write)")
    rows = []
    for block_size in (16, 256):
        for batch, context in itertools.product((1, 64, 256), (512, 2048)):
            for cuda_kernel in (False, True) if KV_FP8 and fp8_cuda.usable(device) else (False,):
                ms, gbs, err, splits = bench_decode(batch, context, block_size, cuda_kernel=cuda_kernel)
                rows.append(
                    f"decode{'-cuda' if cuda_kernel else '     '} B={batch:<4} ctx={context:<5} bs={block_size:<4} "
                    f"{ms * 1e3:10.1f} us {gbs:8.0f} GB/s   rel_err {err:.1e}  splits={splits}"
                )
        for batch, context in itertools.product((1, 64), (512, 2048)):
            two_us, fused_us, same, splits = bench_decode_merge(batch, context, block_size)
            rows.append(
                f"merge    B={batch:<4} ctx={context:<5} bs={block_size:<4} graph: two launches {two_us:7.1f} us, "
                f"fused {fused_us:7.1f} us ({two_us - fused_us:+.1f})  splits={splits}  same bits: {same}"
            )
        ms, tflops, err = bench_prefill(16, 1024, block_size)
        rows.append(
            f"prefill  16x1024         bs={block_size:<4} {ms * 1e3:10.1f} us {tflops:8.1f} TFLOP/s rel_err {err:.1e}"
        )
        ms, gbs = bench_store(16 * 1024, block_size)
        rows.append(f"store_kv T=16384         bs={block_size:<4} {ms * 1e3:10.1f} us {gbs:8.0f} GB/s")
    for decodes, prompts, prompt_len in ((250, 2, 390), (250, 6, 128), (200, 1, 1024), (8, 1, 512)):
        ways, err = bench_mixed(decodes, 1024, prompts, prompt_len, 16)
        timings = ", ".join(f"{way} {host:5.1f} / {gpu:7.1f}" for way, (host, gpu) in ways.items())
        rows.append(f"mixed    {decodes} decodes + {prompts}x{prompt_len} prompt, ctx 1024 bs=16 "
                    f"(host us/layer no sync / GPU us): {timings}   rel_err {err:.1e}")
    sdpa = bench_sdpa_prefill(16, 1024)
    rows.append(f"torch SDPA causal 16x1024 (contiguous, unpaged; reference point): {sdpa:.1f} TFLOP/s")
    print("\n" + "\n".join(rows), flush=True)
    if args.sweep:
        sweep()


if __name__ == "__main__":
    main()
