"""ReadbackBuffers: the pinned buffers of the token readback are reused only once their copy has run.

Why: reusing a pinned buffer whose device-to-host copy is still queued would hand one step's tokens
to another; the pool decides by an event query (never a wait) and allocates a fresh buffer otherwise.
CUDA events and pinned memory are faked here (CPU CI); the CUDA path itself runs in the GPU checks."""
from __future__ import annotations

import torch

from spmd_engine.executor import token_readback
from spmd_engine.executor.token_readback import ReadbackBuffers, _Slot


class FakeEvent:
    def __init__(self, done: bool = True) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def _slot(rows: int, done: bool) -> _Slot:
    return _Slot(torch.zeros(rows, dtype=torch.int64), FakeEvent(done))


def _fresh_allocations(monkeypatch) -> list[int]:
    """Count the pool's new buffers (pinned memory and CUDA events faked)."""
    made: list[int] = []
    real_empty = torch.empty

    def empty(rows, dtype=None, pin_memory=False):
        assert pin_memory
        made.append(rows)
        return real_empty(rows, dtype=dtype)

    monkeypatch.setattr(token_readback, "torch", type("T", (), {"empty": staticmethod(empty),
                                                                "cuda": type("C", (), {"Event": FakeEvent})}))
    return made


def test_reuses_a_buffer_whose_copy_has_run(monkeypatch):
    made = _fresh_allocations(monkeypatch)
    pool = ReadbackBuffers()
    done = _slot(256, done=True)
    pool.give_back(done)
    assert pool.take(200, torch.int64) is done
    assert made == []


def test_never_reuses_a_buffer_whose_copy_is_queued(monkeypatch):
    made = _fresh_allocations(monkeypatch)
    pool = ReadbackBuffers()
    busy = _slot(256, done=False)
    pool.give_back(busy)
    fresh = pool.take(200, torch.int64)
    assert fresh is not busy and made == [256]
    busy.copied.done = True  # its copy ran: the next step may take it
    assert pool.take(200, torch.int64) is busy


def test_too_small_or_other_dtype_is_not_reused(monkeypatch):
    made = _fresh_allocations(monkeypatch)
    pool = ReadbackBuffers()
    pool.give_back(_slot(256, done=True))
    assert pool.take(300, torch.int64).host.shape[0] == 300
    assert pool.take(10, torch.int32).host.dtype == torch.int32
    assert made == [300, 256]


def test_pool_is_bounded():
    pool = ReadbackBuffers()
    for _ in range(10):
        pool.give_back(_slot(256, done=True))
    assert len(pool._free) == token_readback._POOL_MAX


def test_cpu_readback_is_the_tokens():
    tokens = torch.tensor([3, 1, 4], dtype=torch.int64)
    readback = token_readback.TokenReadback(tokens, ReadbackBuffers())
    assert readback.numpy().tolist() == [3, 1, 4]
