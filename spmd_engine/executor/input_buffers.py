"""InputBuffers: one step's model inputs staged in a persistent pinned buffer, copied in one go.

Every field has a fixed place in one byte buffer on the host (pinned) and one on the device, so a
step costs one host->device copy and no allocation, and the device views keep their addresses from
step to step: the decode CUDA graphs are captured on exactly these views. The block table comes
last, so the copy stops after the rows this step uses.

On CUDA the copy runs on a stream of its own, after the steps queued so far (the forward in flight
reads these buffers): a copy queued between the forward and the sampling of the step in flight would
hold the sampling back by the copy engine's turnaround (~20 µs a step on an H200) while it only has
to land before the next forward. `load(..., wait=False)` leaves that wait to `wait_copied`, which the
runner calls right before the next forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from spmd_engine.models.attention_metadata import AttentionMetadata
from spmd_engine.executor.forward_batch import BATCH_FIELDS, TOKENS, ForwardBatch, HostBatch

_ALIGN = 256  # bytes; keeps every view aligned like a fresh allocation (Triton specialises on it)
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}
_TORCH = {np_type: torch_type for torch_type, np_type in _NUMPY.items()}


@dataclass(frozen=True)
class BufferField:
    name: str
    dtype: torch.dtype
    numel: int
    offset: int  # bytes from the start of the buffer

    @property
    def nbytes(self) -> int:
        return self.numel * torch.tensor([], dtype=self.dtype).element_size()


def _layout(max_tokens: int, max_seqs: int, max_blocks: int) -> tuple[dict[str, BufferField], int]:
    fields, offset = {}, 0
    for spec in BATCH_FIELDS:
        field = BufferField(spec.name, _TORCH[spec.dtype], spec.capacity(max_tokens, max_seqs, max_blocks), offset)
        fields[spec.name] = field
        offset += -(-field.nbytes // _ALIGN) * _ALIGN
    return fields, offset


class InputBuffers:
    """Capacity: `max_tokens` tokens and `max_seqs` sequences of `max_blocks` KV blocks per step."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int,
                 device: torch.device) -> None:
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.block_size = block_size
        self.device = device
        self.fields, total = _layout(max_tokens, max_seqs, max_blocks)
        self.host = torch.zeros(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.dev = torch.zeros(total, dtype=torch.uint8, device=device)
        host_np = self.host.numpy()
        self._np = {n: host_np[f.offset:f.offset + f.nbytes].view(_NUMPY[f.dtype]) for n, f in self.fields.items()}
        self._dev = {n: self.dev[f.offset:f.offset + f.nbytes].view(f.dtype) for n, f in self.fields.items()}
        self._np["block_tables"] = self._np["block_tables"].reshape(max_seqs, max_blocks)
        self._dev["block_tables"] = self._dev["block_tables"].view(max_seqs, max_blocks)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # the copies' own stream

    def fits(self, host: HostBatch, rows: int | None = None) -> bool:
        rows = host.num_seqs if rows is None else rows
        return (host.num_tokens <= self.max_tokens and rows <= self.max_seqs and rows <= self.max_tokens
                and host.block_tables.shape[1] == self.max_blocks)

    def device_view(self, name: str, n: int) -> torch.Tensor:
        """The first n entries (rows of the block table) of field `name` on the device: what graphs read."""
        return self._dev[name][:n]

    def wait_copied(self) -> None:
        """The current stream waits for the last `load`'s copy (nothing to wait for off CUDA)."""
        if self._copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied)

    def load(self, host: HostBatch, rows: int | None = None, pad_tokens: int | None = None,
             wait: bool = True) -> ForwardBatch:
        """Stage `host` and copy it to the device; return device views of this step's inputs.

        `rows` pads a decode batch to that many sequences (one token each) for the decode graph of that
        size: padded rows have slot -1 (nothing stored) and seq_len 0 (the decode kernel returns zeros for
        them), and `logits_indices` spans all `rows` (the sampled rows first, in plan order). `pad_tokens`
        pads only the token fields to that many tokens (input 0, position 0, slot -1) and the unused
        logits rows to row 0 (the piecewise graphs); the returned views stay the real step's.
        `wait=False`: the current stream does not wait for the copy yet; call `wait_copied` before the
        views are read or written on it (CUDA).
        """
        num_seqs, num_tokens = host.num_seqs, host.num_tokens
        for_graph = rows is not None
        rows = num_seqs if rows is None else rows
        if rows != num_seqs and not (host.is_decode and rows > num_seqs):
            raise ValueError(f"only a decode batch can be padded, got {num_seqs} seqs -> {rows} rows")
        tokens = num_tokens + rows - num_seqs
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the staging buffer
        a = self._np
        for spec in BATCH_FIELDS:
            value = getattr(host, spec.name)
            a[spec.name][: len(value)] = value
        if rows > num_seqs:  # padding rows, as BATCH_FIELDS declares them
            for spec in BATCH_FIELDS:
                if spec.pad is not None:
                    start, end = (num_tokens, tokens) if spec.extent == TOKENS else (num_seqs, rows)
                    a[spec.name][start:end] = spec.pad
            a["cu_seqlens_q"][num_seqs + 1: rows + 1] = np.arange(num_tokens + 1, tokens + 1, dtype=np.int32)
        if pad_tokens is not None:
            if not num_tokens <= pad_tokens <= self.max_tokens:
                raise ValueError(f"cannot pad {num_tokens} tokens to {pad_tokens} (capacity {self.max_tokens})")
            for spec in BATCH_FIELDS:
                if spec.extent == TOKENS:
                    a[spec.name][num_tokens:pad_tokens] = spec.pad
            a["logits_indices"][len(host.logits_indices):] = 0
        num_logits = len(host.logits_indices)
        if for_graph:  # a decode graph gathers the hidden rows of logits_indices[:rows]: past the sampled
            a["logits_indices"][num_logits:rows] = np.arange(num_logits, rows)  # rows, real ones' logits unread
            num_logits = rows
        tables = self.fields["block_tables"]
        end = tables.offset + rows * self.max_blocks * 4
        if self._stream is None or torch.cuda.is_current_stream_capturing():
            self.dev[:end].copy_(self.host[:end], non_blocking=True)
            if self._copied is not None:
                self._copied.record()
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # its readers queued so far
            with torch.cuda.stream(self._stream):
                self.dev[:end].copy_(self.host[:end], non_blocking=True)
            self._copied.record(self._stream)
            if wait:
                self.wait_copied()
        d = self._dev
        attn = AttentionMetadata(
            slot_mapping=d["slot_mapping"][:tokens], cu_seqlens_q=d["cu_seqlens_q"][: rows + 1],
            seq_lens=d["seq_lens"][:rows], block_tables=d["block_tables"][:rows],
            max_query_len=host.max_query_len, max_seq_len=host.max_seq_len, block_size=self.block_size,
            is_decode=host.is_decode, num_decode_seqs=host.num_decode_seqs + rows - num_seqs)
        return ForwardBatch(d["input_ids"][:tokens], d["positions"][:tokens], attn, d["logits_indices"][:num_logits],
                            d["feed_rows"][:tokens], host.num_fed)

