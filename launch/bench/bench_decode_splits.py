"""GPU benchmark: the bf16 CUDA decode kernel (kernels/decode_attention_cuda.py) at every split count, against the
count the split rule picks, replayed from CUDA graphs at Qwen3-0.6B heads (prints a table).

Run: `python launch/bench/bench_decode_splits.py [--small]`. Each row: one layer's decode attention for
`rows` sequences of the context range shown (longest first, as the engine orders them), block tables 256 blocks
wide as in the engine's decode graphs (max_model_len 4096 at block 16), µs per launch (median of graph replays
of 20 launches) for the rule's count, the best count and each count tried. `--small`: 1-16 rows.
"""
from __future__ import annotations

import argparse

import torch

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
import bench_attention
import spmd_engine.kernels.decode_attention as da
import spmd_engine.kernels.decode_attention_cuda as cuda16
from bench_attention import HEAD_DIM, NUM_KV_HEADS
from bench_fused_ops import graph_ms

BLOCK_SIZE = 16
TABLE_WIDTH = 256  # blocks: the decode graphs' tables are max_model_len wide
LAUNCHES = 20  # per graph replay
MIXES = [(4, 600, 2048), (8, 600, 2048), (16, 600, 2048), (24, 600, 2048), (32, 600, 2048), (48, 500, 2048),
         (64, 400, 2048), (96, 300, 2048), (128, 200, 2048), (192, 100, 2048), (256, 100, 2048)]
SMALL_MIXES = [(1, 256, 256), (1, 1024, 1024), (1, 2048, 2048), (2, 1024, 1024), (2, 600, 2048), (4, 1024, 1024),
               (4, 600, 2048), (8, 1024, 1024), (8, 600, 2048), (12, 600, 2048), (16, 1024, 1024)]
SPLITS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="1-16 rows instead of 4-256")
    small = parser.parse_args().small
    if not torch.cuda.is_available() or not cuda16.usable(torch.device("cuda")):
        raise SystemExit("bench_decode_splits.py needs a CUDA GPU of compute capability 8.0+ and NVRTC")
    gen = torch.Generator().manual_seed(1)
    bench_attention.KV_FP8 = False
    cfg = cuda16.decode_config()
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}; rows x keys: rule (splits) us TB/s | best | "
          "splits:us")
    for rows, lo, hi in SMALL_MIXES if small else MIXES:
        lengths = sorted((int(x) for x in torch.randint(lo, hi + 1, (rows,), generator=gen)), reverse=True)
        query, k, v, _, seq_lens, tables = bench_attention.paged_inputs(1, tuple(lengths), BLOCK_SIZE)
        wide = torch.zeros(rows, TABLE_WIDTH, dtype=torch.int32, device="cuda")
        wide[:, : tables.shape[1]] = tables
        out = torch.empty_like(query)
        kv_bytes = sum(lengths) * NUM_KV_HEADS * HEAD_DIM * 2 * k.element_size()

        def us(splits: int) -> float:
            def launches() -> None:
                for _ in range(LAUNCHES):
                    cuda16.paged_decode_attention_cuda(query, k, v, seq_lens, wide, 0.088, out=out, num_splits=splits)
            return 1000 * graph_ms(launches) / LAUNCHES

        rule = da.split_count("bench", None, rows, k, wide, cfg)
        times = {s: us(s) for s in sorted(set(SPLITS) | {rule})}
        best = min(times, key=times.get)
        print(f"{rows:4d} x {lo}..{hi}: rule ({rule}) {times[rule]:6.1f} us {kv_bytes / times[rule] / 1e6:4.2f} TB/s | "
              f"best ({best}) {times[best]:6.1f} us | " + " ".join(f"{s}:{t:.1f}" for s, t in times.items()),
              flush=True)


if __name__ == "__main__":
    main()
