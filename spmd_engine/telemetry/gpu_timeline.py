"""GpuTimeline: how long the GPU waits for the host between steps, from CUDA events.

Host clocks cannot tell host work that overlaps the GPU from host work the GPU waits for; events
recorded around each step's forward and sampling can. A step's events are read once the next
step's forward has started on the GPU (a non-blocking query), so measuring adds no
synchronisation and only the few steps in flight hold events.
"""
from __future__ import annotations

import torch

MARKS = ("forward_start", "forward_end", "sample_start", "sample_end")


class GpuTimeline:
    """Four events per step; `idle_ms()` is, per step, the time from that step's forward start to the
    next one's minus the GPU time inside the forward and the sampling (None for the last step), and
    `busy_ms()` that GPU time: what a step costs the GPU, which host clocks cannot tell under async
    scheduling (a step's GPU work is waited for in a later step)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        # the loop's stream, looked up once (each lookup is a few µs of host time, four marks per step), and
        # the events of steps already read, recorded again (no event created per mark)
        self._stream = torch.cuda.current_stream() if enabled else None
        self._spare: list[torch.cuda.Event] = []
        self._marks: dict[int, dict[str, torch.cuda.Event]] = {}  # steps whose idle time is not read yet
        self._idle: list[float | None] = []  # steps 0, 1, ... whose idle time is read
        self._busy: list[float | None] = []  # their GPU time inside the forward and the sampling

    def mark(self, step_index: int, name: str) -> None:
        if not self.enabled:
            return
        event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        self._marks.setdefault(step_index, {})[name] = event
        if name == "forward_start":
            self._read(wait=False)

    def idle_ms(self) -> list[float | None]:
        """Per step; None where a mark is missing (the last step, steps never sampled)."""
        if not self.enabled:
            return []
        torch.cuda.synchronize()
        self._read(wait=True)
        return list(self._idle)

    def busy_ms(self) -> list[float | None]:
        """Per step (after `idle_ms`, which reads the last events); None where a mark is missing."""
        return list(self._busy) if self.enabled else []

    def _read(self, wait: bool) -> None:
        """Read, in step order, the steps whose successor's forward has started on the GPU (every
        step when `wait`: the caller synchronised); their events are recorded again by later marks."""
        while len(self._idle) in self._marks:
            step = len(self._idle)
            this = self._marks[step]
            following = self._marks.get(step + 1, {}).get("forward_start")
            if not wait and (following is None or not following.query()):
                return
            if following is None or not all(m in this for m in MARKS):
                self._idle.append(None)
                self._busy.append(None)
            else:
                span = this["forward_start"].elapsed_time(following)
                busy = (this["forward_start"].elapsed_time(this["forward_end"])
                        + this["sample_start"].elapsed_time(this["sample_end"]))
                self._idle.append(max(0.0, span - busy))
                self._busy.append(busy)
            self._spare.extend(self._marks.pop(step).values())
