"""GpuTimeline: how long the GPU waits for the host between steps, from CUDA events.

Host clocks cannot tell host work that overlaps the GPU from host work the GPU waits for; events
recorded around each step's forward and sampling can. They are read once, after the run, so
measuring adds no synchronisation.
"""
from __future__ import annotations

import torch

MARKS = ("forward_start", "forward_end", "sample_start", "sample_end")


class GpuTimeline:
    """Four events per step; `idle_ms()` is, per step, the time from that step's forward start to the
    next one's minus the GPU time inside the forward and the sampling (None for the last step)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._steps: list[dict[str, torch.cuda.Event]] = []

    def mark(self, step_index: int, name: str) -> None:
        if not self.enabled:
            return
        while len(self._steps) <= step_index:
            self._steps.append({})
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._steps[step_index][name] = event

    def idle_ms(self) -> list[float | None]:
        """Per step; None where a mark is missing (the last step, steps never sampled)."""
        if not self.enabled:
            return []
        torch.cuda.synchronize()
        out: list[float | None] = []
        for this, following in zip(self._steps, self._steps[1:] + [{}]):
            if not all(m in this for m in MARKS) or "forward_start" not in following:
                out.append(None)
                continue
            span = this["forward_start"].elapsed_time(following["forward_start"])
            busy = (this["forward_start"].elapsed_time(this["forward_end"])
                    + this["sample_start"].elapsed_time(this["sample_end"]))
            out.append(max(0.0, span - busy))
        return out
