"""DecodeGraphs: decode steps replayed from CUDA graphs, one graph per padded batch size.

A decode step of a small model is hundreds of tiny kernels; launching them one by one from Python
costs more than running them. Each graph covers the whole step, LM head (and its gather to tensor-
parallel rank 0) included, over the runner's persistent input buffers. Every rank captures the same
sizes in the same order (the graphs hold NCCL collectives) into one shared memory pool, largest
first so the smaller graphs reuse its memory; `close` frees them before the process group goes.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from spmd_engine.executor.forward_batch import ForwardBatch, HostBatch
from spmd_engine.executor.input_buffers import InputBuffers

# decode graphs of at most this many rows launch their Triton kernels with Programmatic Dependent Launch
# (off with debug.cuda_pdl=false). H200, `python launch/bench/bench_pdl.py`: a Qwen3-0.6B decode step is
# 9.7 % faster at 1 row, 2.7 % at 16, 0.6 % at 128, and 0.6 % slower at 256
PDL_MAX_ROWS = 128


log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # compile every Triton specialisation and initialise NCCL before capturing


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, then max_num_seqs itself (all <= max_num_seqs)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {n for n in (1, 2, 4, 8) if n <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def smallest_holding(sizes: list[int], n: int) -> int:
    """The smallest of the sorted `sizes` that is >= n (the graph a padded step replays)."""
    return sizes[bisect.bisect_left(sizes, n)]


def decode_step(model: torch.nn.Module, batch: ForwardBatch, feed: torch.Tensor) -> torch.Tensor | None:
    """What one graph records: the deferred input ids from `feed` (the runner's token feed, where the
    previous step's tokens are by then: no eager launch between that step's draw and this graph), the
    forward over every (padded) row, then logits for every row in `logits_indices` order (the sampled
    rows first, in plan order: the batch is longest-first)."""
    batch.feed_from(feed)
    hidden = model(batch.input_ids, batch.positions, batch.attn)
    return model.compute_logits(hidden.index_select(0, batch.logits_indices))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor | None  # static output [rows, vocab] on tp rank 0, None elsewhere


class DecodeGraphs:
    def __init__(self, buffers: InputBuffers, graphs: dict[int, _Graph]) -> None:
        self.buffers = buffers
        self.graphs = graphs
        self.sizes = sorted(graphs)
        self.num_replays = 0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    @classmethod
    @torch.inference_mode()
    def capture(cls, model: torch.nn.Module, buffers: InputBuffers, max_num_seqs: int, feed: torch.Tensor,
                pool=None, pdl_max_rows: int = 0) -> DecodeGraphs:
        """Capture every size of `graph_batch_sizes(max_num_seqs)` over `buffers` (the runner's own:
        the graphs read and write exactly those views) and the token `feed` (int64, >= max_num_seqs:
        a replay takes its deferred inputs from there); `pool`: a graph memory pool to share (the
        piecewise graphs'), None for a new one. The graphs of at most `pdl_max_rows` rows launch their
        Triton kernels with Programmatic Dependent Launch (kernels/pdl.py; where it can run)."""
        from spmd_engine.kernels.pdl import pdl_launches

        max_blocks = buffers.max_blocks
        sizes = [n for n in graph_batch_sizes(max_num_seqs) if n <= buffers.max_tokens]
        started = time.perf_counter()
        reserved_before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        side = torch.cuda.Stream()
        graphs: dict[int, _Graph] = {}
        for n in reversed(sizes):
            batch = buffers.load(HostBatch.padding(n, max_blocks), rows=n)
            with pdl_launches(n <= pdl_max_rows):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_RUNS):
                        decode_step(model, batch, feed)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    logits = decode_step(model, batch, feed)
            graphs[n] = _Graph(graph, logits)
        torch.cuda.synchronize()
        log.info("CUDA graphs: %d decode batch sizes (%s) captured in %.1f s, %.2f GiB reserved",
                 len(sizes), _ranges(sizes), time.perf_counter() - started,
                 (torch.cuda.memory_reserved() - reserved_before) / (1 << 30))
        return cls(buffers, graphs)

    def can_run(self, host: HostBatch) -> bool:
        return host.is_decode and 0 < host.num_seqs <= self.max_batch and self.buffers.fits(host)

    def padded_size(self, num_seqs: int) -> int:
        return smallest_holding(self.sizes, num_seqs)

    def stage(self, host: HostBatch) -> tuple[int, ForwardBatch]:
        """Copy the batch into the captured buffers, padded to the smallest graph that holds it (the
        copy is waited for by `InputBuffers.wait_copied` before the replay)."""
        rows = self.padded_size(host.num_seqs)
        return rows, self.buffers.load(host, rows=rows, wait=False)

    def replay(self, rows: int, host: HostBatch) -> torch.Tensor | None:
        """Replay graph `rows` (its deferred inputs must be in the feed by now); logits of the sampled rows
        on tp rank 0.

        The logits are a view of the graph's static output: valid until the next replay.
        """
        captured = self.graphs[rows]
        captured.graph.replay()
        self.num_replays += 1
        if captured.logits is None:
            return None
        return captured.logits[: len(host.logits_indices)]

    @staticmethod
    def samples_every_row(host: HostBatch) -> bool:
        """Every row samples (a pure decode step): what the sampler graphs draw, the first num_seqs rows
        of the graph's static output."""
        return len(host.logits_indices) == host.num_seqs

    def static_logits(self) -> dict[int, torch.Tensor]:
        """rows -> the static logits output [rows, vocab] of each graph (tp rank 0; empty elsewhere)."""
        return {n: captured.logits for n, captured in self.graphs.items() if captured.logits is not None}

    def close(self) -> None:
        """Drop every graph and its pool (before destroy_process_group: NCCL hangs otherwise)."""
        for captured in self.graphs.values():
            captured.graph.reset()
        self.graphs.clear()
        self.sizes = []
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _ranges(sizes: list[int]) -> str:
    return ", ".join(str(n) for n in sizes) if len(sizes) <= 6 else f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}"
