"""TokenReadback: a step's sampled tokens copied to the host without stalling the GPU queue.

`tensor.cpu()` waits for every kernel queued before it, including the next step's forward once
the loop plans ahead; a non-blocking copy into pinned memory plus an event waits only for the
sampling itself. The pinned buffers and their events come from a `ReadbackBuffers` pool: a fresh
pinned tensor and CUDA event every step cost rank 0 an allocation and an event creation per step.
With a pool the copy runs on the pool's own stream after the sampling: on the compute stream the
copy engine's turnaround (~10 µs a step on an H200) would sit between the sampling and the next
forward, which does not need the host copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# buffers kept for reuse at most: one step in flight needs one (two while a step's readback overlaps the next)
_POOL_MAX = 4
_MIN_ROWS = 256  # a buffer holds at least this many tokens (the default max_num_seqs): one size fits most steps


@dataclass(eq=False)  # compared by identity (its fields are tensors)
class _Slot:
    """One pinned host buffer and the event recorded after the last copy into it."""

    host: torch.Tensor
    copied: torch.cuda.Event


class ReadbackBuffers:
    """Pinned buffers for token readbacks, reused step after step (CUDA only).

    A buffer goes back to the pool only after its readback was waited for and its tokens copied out
    (`TokenReadback.numpy`), and is taken again only if its event says the copy into it has completed
    (a query: the host never waits here); otherwise a fresh one is allocated."""

    def __init__(self) -> None:
        self._free: list[_Slot] = []
        self._stream: torch.cuda.Stream | None = None  # the copies' own stream (made on first use)
        self._unread: list[_Slot] = []  # copies taken out and not yet waited for by the host

    def copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def copied_on_stream(self, slot: _Slot) -> None:
        """`slot`'s copy was queued on the pool's stream: fences order later overwrites after it until the
        host has waited for it."""
        self._unread.append(slot)

    def fence(self) -> None:
        """The current stream waits for every copy the host has not waited for yet: what a kernel that
        overwrites sampled tokens (a sampler graph's static output) must come after. In the step loop the
        host has waited for the last one already, so nothing is queued."""
        for slot in self._unread:
            torch.cuda.current_stream().wait_event(slot.copied)
        self._unread.clear()

    def take(self, rows: int, dtype: torch.dtype) -> _Slot:
        free = self._free
        for i in range(len(free) - 1, -1, -1):
            slot = free[i]
            if slot.host.shape[0] >= rows and slot.host.dtype == dtype and slot.copied.query():
                return free.pop(i)
        return _Slot(torch.empty(max(rows, _MIN_ROWS), dtype=dtype, pin_memory=True), torch.cuda.Event())

    def give_back(self, slot: _Slot) -> None:
        if slot in self._unread:
            self._unread.remove(slot)
        if len(self._free) < _POOL_MAX:
            self._free.append(slot)


class TokenReadback:
    def __init__(self, tokens: torch.Tensor, buffers: ReadbackBuffers | None = None) -> None:
        """`tokens`: [N] on the device. `buffers`: where the pinned buffer comes from and goes back to
        (None: a fresh one, not reused)."""
        self._buffers = buffers
        if tokens.device.type == "cuda":
            n = tokens.numel()
            self._slot = (buffers.take(n, tokens.dtype) if buffers is not None
                          else _Slot(torch.empty(n, dtype=tokens.dtype, pin_memory=True), torch.cuda.Event()))
            self._host = self._slot.host[:n].view(tokens.shape)
            if buffers is None or torch.cuda.is_current_stream_capturing():
                self._host.copy_(tokens, non_blocking=True)
                self._slot.copied.record()
            else:  # on the pool's stream, after the sampling queued so far
                stream = buffers.copy_stream(tokens.device)
                stream.wait_stream(torch.cuda.current_stream(tokens.device))
                with torch.cuda.stream(stream):
                    self._host.copy_(tokens, non_blocking=True)
                self._slot.copied.record(stream)
                tokens.record_stream(stream)  # an eager draw's tokens stay allocated until the copy ran
                buffers.copied_on_stream(self._slot)
        else:
            self._slot, self._host = None, tokens

    def numpy(self) -> np.ndarray:
        """Wait for the copy (only the sampling queued before it) and return the tokens."""
        slot = self._slot
        if slot is None:
            return self._host.numpy()
        slot.copied.synchronize()
        tokens = self._host.numpy().copy()  # the caller's own array: the pinned buffer is reused
        self._slot = None
        if self._buffers is not None:
            self._buffers.give_back(slot)
        self._host = torch.from_numpy(tokens)  # a second call gives the same tokens
        return tokens
