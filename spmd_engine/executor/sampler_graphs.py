"""SamplerGraphs: rank 0 samples a decode step by replaying a CUDA graph (uniform batches only).

Why: at batch 1 the host step is as long as the GPU step, and sampling is its largest phase: the
eager sampler packs and copies the keys, then launches the race kernel, an argmax and a gather, each
launch tens of microseconds of Python while the GPU waits between the decode graph and the next
step. A batch whose rows all take one of the sampler's fixed-launch paths ("greedy": argmax;
"plain": the fused temperature race; "top_k": the top-k kernel, with or without top-p, k up to
`sampler.GRAPH_TOP_K_MAX`: Qwen3's defaults; `sampler.UNIFORM_KINDS`) is drawn here instead: one graph per
(decode graph size, kind), captured over that decode graph's static logits, a static key buffer and
a static token output; a step packs its keys once, copies them in one non-blocking host-to-device
copy (`sampler._KeyStaging`, the host never waits) and replays.

Same bits as the eager path: both run `sampler.sample_uniform` (the same kernels) on the same
logits and keys; a graph of `rows` rows covers the decode graph's padding rows too, with temperature 0,
which the race and the top-k kernel skip (~10 % of the race's work at 129 of 144 rows; the greedy argmax
takes them, harmlessly): their tokens are garbage nobody reads. Every launch treats rows apart, so a row's
token still depends on its own logits, seed, counter, temperature (and top_k, top_p) only. Every other
step (top-p alone, top-k past GRAPH_TOP_K_MAX, mixed paths, rows with logits processors or logprobs, steps
not replayed from a decode graph, or not sampling every row) keeps the eager sampler. Used wherever it
applies; the developer override `debug.sampler_graphs=false` turns it off for A/B benches.

The tokens a replay returns are its static output, the first rows of the runner's token feed (where the
next decode graph takes its deferred inputs from, with no eager launch between the two graphs): valid
until the next sampler replay, which the step loop queues only after the next step's forward has taken
them and after their readback (`ReadbackBuffers.fence`), or until the runner copies an eager draw's tokens
into the feed, two launches later, when the host has read these back.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from spmd_engine.executor.sampler import (GRAPH_TOP_K_MAX, UNIFORM_KINDS, SamplingBatch, _KeyStaging, sample_uniform,
                                          uniform_kind)

log = logging.getLogger(__name__)

_ALIGN_ROWS = 4  # each key section starts 32-byte aligned (Triton specialises pointers on 16-byte alignment)
# the keys of padding rows: temperature 0 (never a real row's: those are greedy) makes the race skip them
PAD_SEED, PAD_COUNTER, PAD_TEMPERATURE = 0, 0, 0.0
PAD_TOP_K, PAD_TOP_P = 1, 1.0  # (read by nothing: the top-k kernel skips a row at temperature 0)
_SECTIONS = {"greedy": 3, "plain": 3, "top_k": 5}  # int64 words per (aligned) row of each kind's keys
_BLOCK_BYTES = 512  # the CUDA caching allocator rounds every block up to this
_SMALL_SEGMENT_BYTES = 2 << 20  # blocks under 1 MiB come from 2 MiB segments
_LARGE_BLOCK_BYTES = 1 << 20  # larger blocks are rounded to 2 MiB and come from 20 MiB segments (under 10 MiB)
_LARGE_ROUND_BYTES, _LARGE_SEGMENT_BYTES = 2 << 20, 20 << 20


def _aligned(rows: int) -> int:
    return -(-rows // _ALIGN_ROWS) * _ALIGN_ROWS


def pack_keys(batch: SamplingBatch, rows: int, kind: str = "plain") -> np.ndarray:
    """A graph of `rows` rows' keys as one int64 array [3 * rows4] (rows4: rows rounded up to 4): the
    seeds, the counters, then the float32 temperatures (two per word); "top_k" [5 * rows4]: then the
    top_k and the float64 top_p. Rows past the batch are padding (PAD_SEED, PAD_COUNTER, PAD_TEMPERATURE,
    PAD_TOP_K, PAD_TOP_P)."""
    n = len(batch)
    if not 0 < n <= rows:
        raise ValueError(f"pack_keys: a batch of {n} rows does not fit a {rows}-row graph")
    r4 = _aligned(rows)
    buf = np.zeros(_SECTIONS[kind] * r4, dtype=np.int64)
    if kind == "top_k":
        buf[3 * r4:3 * r4 + n] = batch.top_k
        buf[3 * r4 + n:4 * r4] = PAD_TOP_K
        top_p = buf[4 * r4:].view(np.float64)
        top_p[:n] = batch.top_p
        top_p[n:] = PAD_TOP_P
    buf[:n] = batch.seeds
    buf[n:rows] = PAD_SEED
    buf[r4:r4 + n] = batch.counters
    buf[r4 + n:r4 + rows] = PAD_COUNTER
    temps = buf[2 * r4:].view(np.float32)
    temps[:n] = batch.temperatures  # float64 -> float32 rounds to nearest, as the eager packing does
    temps[n:rows] = PAD_TEMPERATURE
    return buf


@dataclass
class KeyViews:
    """A graph's views of the static key buffer (the layout of `pack_keys` for its row count)."""

    packed: torch.Tensor  # int64 [3 * rows4] ("top_k": [5 * rows4]): what one step's copy fills
    seeds: torch.Tensor  # int64 [rows]
    counters: torch.Tensor  # int64 [rows]
    temperatures: torch.Tensor  # float32 [rows]
    top_k: torch.Tensor  # int64 [rows] (read by "top_k" graphs only)
    top_p: torch.Tensor  # float64 [rows] (read by "top_k" graphs only)

    @classmethod
    def of(cls, keys: torch.Tensor, rows: int, kind: str = "plain") -> "KeyViews":
        r4 = _aligned(rows)
        packed = keys[:_SECTIONS[kind] * r4]
        return cls(packed, keys[:rows], keys[r4:r4 + rows], keys[2 * r4:3 * r4].view(torch.float32)[:rows],
                   keys[3 * r4:3 * r4 + rows], keys[4 * r4:5 * r4].view(torch.float64)[:rows])


@dataclass
class _SamplerGraph:
    """One (rows, kind): its graph (None: run eagerly, see `SamplerGraphs.eager`) over static tensors."""

    kind: str
    logits: torch.Tensor  # [rows, vocab]: the decode graph's static output
    keys: KeyViews
    tokens: torch.Tensor  # [rows] int64: the static output (the first rows of the token feed, if one was given)
    graph: torch.cuda.CUDAGraph | None
    scratch: torch.Tensor | None = None  # "top_k" on CUDA: the kernel's candidates (made before any capture)

    def draw(self, out: torch.Tensor | None = None) -> torch.Tensor:
        keys = self.keys
        return sample_uniform(self.kind, self.logits, keys.temperatures, keys.seeds, keys.counters, out,
                              keys.top_k, keys.top_p, self.scratch)

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.tokens.copy_(self.draw())


class SamplerGraphs:
    """The sampler graphs of one rank (the one that samples), keyed by (decode graph rows, kind)."""

    def __init__(self, keys: torch.Tensor, graphs: dict[tuple[int, str], _SamplerGraph]) -> None:
        self.keys = keys  # int64 [5 * rows4 of the largest graph]: every graph's key views start at 0
        self.graphs = graphs
        self.sizes = sorted({rows for rows, _ in graphs})
        self._staging = _KeyStaging(keys.device)
        # recorded after each replay: the static keys' last reader, which the next key copy waits for
        self._keys_read = torch.cuda.Event() if keys.device.type == "cuda" else None
        self.num_replays = 0

    @staticmethod
    def _static_keys(max_rows: int, device: torch.device) -> torch.Tensor:
        keys = torch.zeros(_SECTIONS["top_k"] * _aligned(max_rows), dtype=torch.int64, device=device)
        views = KeyViews.of(keys, max_rows, "top_k")  # valid keys: the warm-up runs draw every row
        views.temperatures.fill_(1.0)
        views.top_k.fill_(GRAPH_TOP_K_MAX)
        views.top_p.fill_(0.95)
        return keys

    @classmethod
    @torch.inference_mode()
    def capture(cls, logits_by_rows: dict[int, torch.Tensor], pool=None, out: torch.Tensor | None = None
                ) -> "SamplerGraphs":
        """Capture every kind for every decode graph size (`logits_by_rows`: rows -> that graph's static
        logits [rows, vocab] on this device), largest first, into `pool` (None: a new one, what the
        runner uses). Each draw runs once eagerly on a side stream first (Triton compiles the kernels
        outside the capture); the top-k graphs share one candidate scratch, made before any capture. `out`
        (int64, at least the largest size): every graph draws into its first rows (the runner's token feed,
        which the next decode graph reads its inputs from); None: each graph's own static output.

        Why not the decode graphs' pool: there a token output could lie in a decode graph's temporaries,
        and step N's tokens would then be safe only because every reader (the readback, the next step's
        deferred inputs) is queued before step N+1's forward replays; in a pool of their own (a few KiB
        of blocks, one small segment, counted by `sampler_graph_bytes`) only another sampler replay,
        which comes after the next forward, can overwrite them."""
        started = time.perf_counter()
        device = next(iter(logits_by_rows.values())).device
        keys = cls._static_keys(max(logits_by_rows), device)
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        side = torch.cuda.Stream()
        graphs: dict[tuple[int, str], _SamplerGraph] = {}
        scratch = _top_k_scratch(max(logits_by_rows), next(iter(logits_by_rows.values())).shape[1], device)
        for rows in sorted(logits_by_rows, reverse=True):
            logits = logits_by_rows[rows]
            for kind in UNIFORM_KINDS:
                entry = _SamplerGraph(kind, logits, KeyViews.of(keys, rows, kind), logits.new_empty(0), None,
                                      scratch if kind == "top_k" else None)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    entry.draw()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    entry.tokens = entry.draw(None if out is None else out[:rows])
                entry.graph = graph
                graphs[(rows, kind)] = entry
        torch.cuda.synchronize()
        log.info("CUDA graphs: sampler (greedy, plain, top_k) for %d decode batch sizes captured in %.2f s",
                 len(logits_by_rows), time.perf_counter() - started)
        return cls(keys, graphs)

    @classmethod
    @torch.inference_mode()
    def eager(cls, logits_by_rows: dict[int, torch.Tensor]) -> "SamplerGraphs":
        """The same static buffers and steps with each draw run eagerly instead of replayed: what the
        host side does, on any device (the CPU tests)."""
        device = next(iter(logits_by_rows.values())).device
        keys = cls._static_keys(max(logits_by_rows), device)
        graphs = {(rows, kind): _SamplerGraph(kind, logits, KeyViews.of(keys, rows, kind),
                                              torch.zeros(rows, dtype=torch.int64, device=device), None)
                  for rows, logits in logits_by_rows.items() for kind in UNIFORM_KINDS}
        return cls(keys, graphs)

    @torch.inference_mode()  # the static buffers are inference tensors (made in inference mode)
    def sample(self, rows: int, batch: SamplingBatch) -> torch.Tensor | None:
        """Tokens [len(batch)] of a step whose logits are the first len(batch) rows of decode graph
        `rows`'s static output, drawn by the (rows, kind) graph; None (nothing queued) when the batch is
        not uniform or no graph holds it: the caller samples eagerly. The tokens are a view of the
        graph's static output, valid until its next replay (the step loop reads them back and feeds them
        to the next step before it samples again)."""
        kind = uniform_kind(batch)
        entry = self.graphs.get((rows, kind)) if kind is not None else None
        if entry is None or not 0 < len(batch) <= rows:
            return None
        if kind != "greedy":  # argmax reads no keys
            self._staging.put(pack_keys(batch, rows, kind), into=entry.keys.packed, after=self._keys_read)
        entry.run()
        if self._keys_read is not None:
            self._keys_read.record()
        self.num_replays += 1
        return entry.tokens[:len(batch)]

    def close(self) -> None:
        for entry in self.graphs.values():
            if entry.graph is not None:
                entry.graph.reset()
        self.graphs.clear()
        self.sizes = []


def _top_k_scratch(rows: int, vocab: int, device: torch.device) -> torch.Tensor | None:
    """The top-k graphs' candidate scratch (CUDA; the CPU path needs none)."""
    if device.type != "cuda":
        return None
    from spmd_engine.kernels.top_k_sample import make_scratch
    return make_scratch(rows, vocab, GRAPH_TOP_K_MAX, device)


def sampler_graph_bytes(sizes: list[int], vocab: int) -> int:
    """An upper bound of the memory the sampler graphs keep on the sampling rank: the static keys, the
    fused race's per-row scratch (`sampling_noise._race_state`, made by the largest warm-up draw) and the
    top-k graphs' candidate scratch (`top_k_sample.scratch_numel`; all three outside their pool), and in
    their pool every block each capture allocates (the race's and the top-k draw's tokens, the greedy
    argmax) as if none were reused, each rounded as the CUDA caching allocator rounds it, plus the
    segments those blocks open: a 2 MiB small-block segment in each of their pool and the ordinary pool
    (the keys, the scratch, the warm-up draws' temporaries) and, once a block reaches 1 MiB, a 20 MiB
    large one."""
    from spmd_engine.kernels.top_k_sample import scratch_numel

    def block(nbytes: int) -> int:
        step = _BLOCK_BYTES if nbytes < _LARGE_BLOCK_BYTES else _LARGE_ROUND_BYTES
        return -(-nbytes // step) * step

    if not sizes:
        return 0
    largest = max(sizes)
    blocks = [block(_SECTIONS["top_k"] * _aligned(largest) * 8), block(max(largest, 256) * 8),
              block(max(largest, 256) * 4), block(scratch_numel(largest, vocab, GRAPH_TOP_K_MAX) * 4)]
    for rows in sizes:
        blocks += [block(rows * 8), block(rows * 8), block(rows * 8)]  # race and top-k tokens, greedy argmax
    large = any(b >= _LARGE_BLOCK_BYTES for b in blocks)
    return sum(blocks) + 2 * _SMALL_SEGMENT_BYTES + (_LARGE_SEGMENT_BYTES if large else 0)
