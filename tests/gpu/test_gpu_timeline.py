"""GpuTimeline on a real stream: host gaps show up as idle time, and only steps in flight hold events."""
import time

import torch

from spmd_engine.telemetry.gpu_timeline import GpuTimeline
from tests.gpu.engine_setup import GPU

pytestmark = GPU


def test_host_gaps_are_idle_time_and_events_are_dropped_once_read():
    timeline = GpuTimeline(True)
    x = torch.randn(2048, 2048, device="cuda")
    steps, gap_s = 30, 0.005
    most_held = 0
    for step in range(steps):
        timeline.mark(step, "forward_start")
        x = torch.tanh(x @ x)
        timeline.mark(step, "forward_end")
        timeline.mark(step, "sample_start")
        x.argmax(dim=-1)
        timeline.mark(step, "sample_end")
        if step % 2:  # odd steps: the GPU has finished before the gap, so it idles through it
            torch.cuda.synchronize()
        time.sleep(gap_s)
        most_held = max(most_held, len(timeline._marks))
    idle = timeline.idle_ms()
    assert len(idle) == steps and idle[-1] is None
    assert most_held <= 3, most_held  # read as soon as the next forward has started
    odd = [idle[s] for s in range(1, steps - 1, 2)]
    assert all(v >= 0.8 * gap_s * 1e3 for v in odd), odd
    busy = timeline.busy_ms()
    assert len(busy) == steps and busy[-1] is None
    assert all(0 < b for b in busy[:-1]), busy
    assert all(b < 1e3 * gap_s for b in busy[1:-1]), busy  # a 2048^3 matmul (after the first): below the gap
