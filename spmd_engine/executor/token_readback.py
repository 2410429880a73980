"""TokenReadback: a step's sampled tokens copied to the host without stalling the GPU queue.

`tensor.cpu()` waits for every kernel queued before it, including the next step's forward once
the loop plans ahead; a non-blocking copy into pinned memory plus an event waits only for the
sampling itself.
"""
from __future__ import annotations

import numpy as np
import torch


class TokenReadback:
    def __init__(self, tokens: torch.Tensor) -> None:
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = tokens, None

    def numpy(self) -> np.ndarray:
        """Wait for the copy (only the sampling queued before it) and return the tokens."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.numpy()
