"""PiecewiseGraphs: mixed and prefill steps replayed from CUDA graphs cut at attention.

A mixed step's attention depends on its sequences (how many, how long, which blocks), but
everything else (embedding, norms, projections, rotary, the KV store, MLP, LM head) only on its
token count. So per token-count bucket the forward is captured as num_layers + 1 graphs:

    piece 0      embedding, layer 0 up to attention (norm, qkv, q/k norm, rotary, KV store)
    piece i      layer i-1 after attention (o_proj, residual, norm, MLP), layer i up to attention
    piece L      the last layer after attention, final norm, LM head over the padded logits rows

and attention runs eagerly between them over the real tokens with the real metadata (decode rows
through the decode kernel, prompt chunks through the prefill kernel). The pieces talk through
static buffers (q, the attention output, the residual stream, the rotary tables, the logits),
shared by every bucket; a step's tokens are padded to the bucket with slot -1 / position 0 rows
that store nothing and are never read back.

How a piece is recorded is injected (`Capture`): on CUDA a torch.cuda.CUDAGraph over a memory pool
shared with the decode graphs; on CPU `RerunCapture` "replays" by running the piece again over the
same static buffers, which is how the CPU tests check the buffer plumbing. Every rank captures the
same buckets in the same order (the pieces hold the tensor-parallel collectives).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from spmd_engine.executor.cuda_graphs import smallest_holding
from spmd_engine.executor.forward_batch import ForwardBatch, HostBatch
from spmd_engine.executor.input_buffers import InputBuffers
from spmd_engine.models.attention_metadata import AttentionMetadata

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # compile every Triton specialisation and initialise NCCL before capturing
Piece = Callable[[], None]  # reads and writes only static buffers
Capture = Callable[[Piece], Piece]  # record a piece; returns what replays it


def piecewise_token_buckets(max_tokens: int) -> list[int]:
    """Token counts with a graph: powers of two 16..512, then steps of 256 to 2048, 512 to 4096, 1024 to
    8192, 2048 to 16384 and 4096 beyond; capped by and including max_tokens. Padding stays under a
    quarter from 512 tokens up, where it costs compute (a steady-state mixed step carries ~1,000
    tokens), and the number of graphs (buckets x (layers + 1)) stays small for large budgets."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = [16, 32, 64, 128, 256]
    for start, stop, step in ((512, 2048, 256), (2048, 4096, 512), (4096, 8192, 1024), (8192, 16384, 2048)):
        sizes += range(start, stop, step)
    sizes += range(16384, max_tokens, 4096)
    return sorted({n for n in sizes if n < max_tokens} | {max_tokens})


class CudaGraphCapture:
    """The CUDA `Capture`: each piece one torch.cuda.CUDAGraph in one shared memory pool."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def __call__(self, piece: Piece) -> Piece:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            piece()
        self.graphs.append(graph)
        return graph.replay

    def close(self) -> None:
        torch.cuda.synchronize()  # no replay in flight
        for graph in self.graphs:
            graph.reset()
        self.graphs.clear()


class RerunCapture:
    """The CPU stand-in: a replay runs the piece again over the same static buffers, as a graph would."""

    def __call__(self, piece: Piece) -> Piece:
        piece()
        return piece

    def close(self) -> None:
        pass


class _StaticBuffers:
    """The tensors the pieces pass each other, allocated at the largest bucket on first use."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tensors: dict[str, torch.Tensor] = {}

    def write(self, name: str, value: torch.Tensor) -> None:
        """value [n, ...] -> rows [:n] of the static tensor `name` (nothing to do where the piece wrote
        them in place: q through `AttentionMetadata.q_out`, the residual stream through RMSNorm)."""
        if name not in self.tensors:
            rows = self.max_tokens if name != "logits" else value.shape[0]
            self.tensors[name] = torch.zeros((rows, *value.shape[1:]), dtype=value.dtype, device=value.device)
        rows = self.tensors[name][: value.shape[0]]
        if rows.data_ptr() != value.data_ptr() or rows.stride() != value.stride():
            rows.copy_(value)

    def read(self, name: str, n: int) -> torch.Tensor:
        return self.tensors[name][:n]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class PiecewiseGraphs:
    def __init__(self, model, buffers: InputBuffers, max_num_seqs: int, capture: Capture) -> None:
        self.model = model
        self.buffers = buffers
        self.max_num_seqs = max_num_seqs
        self.capture_fn = capture
        self.layers = model.decoder_layers()
        self.static = _StaticBuffers(buffers.max_tokens)
        self.buckets: dict[int, list[Piece]] = {}  # token count -> its num_layers + 1 replays
        self.sizes: list[int] = []
        self.num_replays = 0

    @classmethod
    @torch.inference_mode()
    def capture(cls, model, buffers: InputBuffers, max_num_seqs: int, sizes: list[int], capture: Capture
                ) -> PiecewiseGraphs:
        """Capture every bucket of `sizes` (largest first: it allocates the static buffers) over `buffers`
        (the runner's own input buffers: the pieces read exactly those views)."""
        graphs = cls(model, buffers, max_num_seqs, capture)
        started = time.perf_counter()
        cuda = buffers.device.type == "cuda"
        side = torch.cuda.Stream() if cuda else None
        for n in sorted(set(sizes), reverse=True):
            if n > buffers.max_tokens:
                raise ValueError(f"piecewise bucket {n} exceeds the input buffers' {buffers.max_tokens} tokens")
            # one token and n - 1 padding ones: positions 0 (within any rotary table), slots -1 (nothing stored)
            buffers.load(HostBatch.unstored_prefill([1]), pad_tokens=n)
            pieces = graphs._pieces(n)
            if not graphs.static.tensors:  # the first run allocates the static buffers, outside any graph
                for piece in pieces:
                    piece()
            if side is not None:  # compile and initialise on a side stream, as torch.cuda.graph wants
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_RUNS):
                        for piece in pieces:
                            piece()
                torch.cuda.current_stream().wait_stream(side)
            graphs.buckets[n] = [capture(piece) for piece in pieces]
        graphs.sizes = sorted(graphs.buckets)
        if cuda:
            torch.cuda.synchronize()
        log.info("CUDA graphs: %d mixed-step token buckets (%s) x %d pieces captured in %.1f s, static buffers "
                 "%.2f GiB", len(graphs.sizes), ", ".join(map(str, graphs.sizes)), len(graphs.layers) + 1,
                 time.perf_counter() - started, graphs.static.nbytes / (1 << 30))
        return graphs

    def _pieces(self, n: int) -> list[Piece]:
        """The num_layers + 1 pieces of bucket `n`, over the input buffers' first n token rows."""
        model, layers, static = self.model, self.layers, self.static
        buffers = self.buffers
        input_ids, positions = buffers.device_view("input_ids", n), buffers.device_view("positions", n)
        logit_rows = buffers.device_view("logits_indices", min(n, self.max_num_seqs))
        # the pieces read only the slot mapping (the KV store); attention gets the step's own metadata
        attn = AttentionMetadata(slot_mapping=buffers.device_view("slot_mapping", n),
                                 cu_seqlens_q=buffers.device_view("cu_seqlens_q", 2),
                                 seq_lens=buffers.device_view("seq_lens", 1),
                                 block_tables=buffers.device_view("block_tables", 1), max_query_len=n,
                                 max_seq_len=n, block_size=buffers.block_size, is_decode=False)

        def before(i: int, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin) -> None:
            attn.q_out = static.read("q", n) if "q" in static.tensors else None  # set up by the first run
            q, _, _, residual = layers[i].before_attention(hidden, residual, cos_sin, attn)
            static.write("q", q)
            static.write("residual", residual)
            if "attn_out" not in static.tensors:  # the eager attention's output: q's shape (this rank's heads)
                static.write("attn_out", torch.zeros_like(q))

        def after(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return layers[i].after_attention(static.read("attn_out", n), static.read("residual", n))

        def cos_sin():
            return static.read("cos", n), static.read("sin", n)

        def first() -> None:
            hidden, (cos, sin) = model.embed(input_ids, positions)
            static.write("cos", cos)
            static.write("sin", sin)
            before(0, hidden, None, (cos, sin))

        def middle(i: int) -> Piece:
            def piece() -> None:
                before(i, *after(i - 1), cos_sin())
            return piece

        def last() -> None:
            hidden = model.final_norm(*after(len(layers) - 1))
            logits = model.compute_logits(hidden.index_select(0, logit_rows))
            if logits is not None:
                static.write("logits", logits)

        return [first] + [middle(i) for i in range(1, len(layers))] + [last]

    def can_run(self, host: HostBatch) -> bool:
        return (bool(self.sizes) and 0 < host.num_tokens <= self.sizes[-1]
                and len(host.logits_indices) <= self.max_num_seqs
                and self.buffers.fits(host))

    def stage(self, host: HostBatch) -> tuple[int, ForwardBatch]:
        """Copy the step into the captured buffers, its tokens padded to the smallest bucket that holds them
        (the copy is waited for by `InputBuffers.wait_copied` before the replay)."""
        n = smallest_holding(self.sizes, host.num_tokens)
        return n, self.buffers.load(host, pad_tokens=n, wait=False)

    def replay(self, n: int, host: HostBatch, batch: ForwardBatch) -> torch.Tensor | None:
        """Run bucket `n`'s pieces with eager attention between them; logits of the sampled rows on tp
        rank 0 (a view of the static logits: valid until the next replay), None elsewhere."""
        replays = self.buckets[n]
        num_tokens = host.num_tokens
        q, out = self.static.read("q", num_tokens), self.static.read("attn_out", num_tokens)
        for layer, piece in zip(self.layers, replays):
            piece()
            layer.self_attn.attn.attend(q, None, None, batch.attn, out=out)
        replays[-1]()
        self.num_replays += 1
        if "logits" not in self.static.tensors or not len(host.logits_indices):
            return None
        return self.static.read("logits", len(host.logits_indices))

    def close(self) -> None:
        """Drop every graph (before destroy_process_group: NCCL hangs otherwise)."""
        close = getattr(self.capture_fn, "close", None)
        if close is not None:
            close()
        self.buckets.clear()
        self.sizes = []
