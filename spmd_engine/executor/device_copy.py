"""Small per-step host data onto the device without making the host wait for the GPU."""
from __future__ import annotations

import torch


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`: on CUDA through pinned memory and a non-blocking copy (a copy from pageable
    memory may wait for the queued forward, which costs async scheduling its overlap); as is elsewhere."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
