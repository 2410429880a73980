"""StepTimer: where rank 0's wall time goes in each step, from host clocks plus GPU idle time.

No device synchronisation is added: GPU time shows up where the host first waits for it (`wait`:
the readback of sampled tokens). With async scheduling the host phases overlap the GPU's forward,
so the host plan work (schedule, broadcast, inputs) says how busy the host is, and `gpu_idle`
(from CUDA events, see GpuTimeline) says how long the GPU waited for it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

PHASES = ("wait", "postprocess", "schedule", "broadcast", "inputs", "sample", "forward")
HOST_PLAN_PHASES = ("schedule", "broadcast", "inputs")  # building, sending and staging the plan
LAUNCHES = ("decode_graph", "piecewise_graph", "eager")  # how a step's forward ran (ModelRunner)


class PhaseClock:
    """The step loop's host phases as laps of one clock, so no gap between two phases goes uncounted:
    `lap(phase)` charges the time since the previous lap (or the start) to `phase`; a phase may lap
    more than once (the sum is kept). `take()` hands a counted step its phases and starts the next
    step's from zero without stopping the clock: the time between two steps, and a turn of the loop
    that launched nothing, go to the next counted step, so the counted steps tile the loop's wall time."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def take(self) -> dict[str, float]:
        """The phases since the previous take (or the start); the clock keeps running from its last lap."""
        seconds, self.seconds = self.seconds, dict.fromkeys(PHASES, 0.0)
        return seconds


@dataclass
class StepTimer:
    """Per-step phase durations (seconds) plus the step's shape; summarised by step kind."""

    num_seqs: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    is_decode: list[bool] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    gpu_idle_ms: list[float | None] = field(default_factory=list)  # per step, CUDA only
    gpu_busy_ms: list[float | None] = field(default_factory=list)  # per step: GPU time of its forward + sampling
    # per step when the caller knows them: sequences with one new token (a non-decode step with some is
    # "mixed", without any "prefill"), and how the forward ran (LAUNCHES)
    num_decode_seqs: list[int | None] = field(default_factory=list)
    launches: list[str | None] = field(default_factory=list)

    def set_gpu_idle(self, per_step_ms: list[float | None], busy_ms: list[float | None] | None = None) -> None:
        for name, values in (("idle", per_step_ms), ("busy", busy_ms or [])):
            if values and len(values) != len(self):
                raise ValueError(f"{len(values)} GPU {name} times for {len(self)} steps")
        self.gpu_idle_ms = list(per_step_ms)
        self.gpu_busy_ms = list(busy_ms or [])

    def add(self, num_seqs: int, num_tokens: int, is_decode: bool, *, num_decode_seqs: int | None = None,
            launch: str | None = None, **durations: float) -> None:
        if set(durations) != set(PHASES):
            raise ValueError(f"step timing needs exactly the phases {PHASES}, got {sorted(durations)}")
        if launch is not None and launch not in LAUNCHES:
            raise ValueError(f"launch must be one of {LAUNCHES}, got {launch!r}")
        self.num_seqs.append(num_seqs)
        self.num_tokens.append(num_tokens)
        self.is_decode.append(is_decode)
        self.num_decode_seqs.append(num_decode_seqs)
        self.launches.append(launch)
        for name, seconds in durations.items():
            self.phases[name].append(seconds)

    def __len__(self) -> int:
        return len(self.num_seqs)

    def summary(self) -> dict:
        """Mean milliseconds per phase for: all steps, decode steps, mixed/prefill steps (and apart:
        mixed steps, with decodes, and pure prefill steps), and decode steps at the largest batch seen;
        plus the host plan work as a fraction of the step time and the steps per launch kind."""
        if not self.num_seqs:
            return {"steps": 0}
        seqs = np.asarray(self.num_seqs)
        decode = np.asarray(self.is_decode)
        with_decodes = np.asarray([n is not None and n > 0 for n in self.num_decode_seqs], dtype=bool)
        known = np.asarray([n is not None for n in self.num_decode_seqs], dtype=bool)
        groups = {"all": np.ones_like(decode), "decode": decode, "prefill_or_mixed": ~decode,
                  "mixed": ~decode & with_decodes, "prefill": ~decode & known & ~with_decodes,
                  "decode_max_batch": decode & (seqs == seqs[decode].max() if decode.any() else False)}
        out: dict = {"steps": len(self)}
        for name, mask in groups.items():
            if mask.any():
                out[name] = self._group(mask, seqs)
        return out

    def _group(self, mask: np.ndarray, seqs: np.ndarray) -> dict:
        ms = {p: np.asarray(v)[mask] * 1e3 for p, v in self.phases.items()}
        step = sum(ms.values())
        host_plan = sum(ms[p] for p in HOST_PLAN_PHASES)
        row = {"steps": int(mask.sum()), "mean_seqs": float(seqs[mask].mean()),
               "mean_tokens": float(np.asarray(self.num_tokens)[mask].mean()),
               "step_ms": float(step.mean()), "step_p50_ms": float(np.percentile(step, 50))}
        row.update({f"{p}_ms": float(v.mean()) for p, v in ms.items()})
        row["host_plan_ms"] = float(host_plan.mean())
        launches = [launch for launch, m in zip(self.launches, mask) if m and launch is not None]
        if launches:
            row["launches"] = {kind: launches.count(kind) for kind in LAUNCHES if kind in launches}
        row["host_plan_fraction"] = float(host_plan.sum() / step.sum()) if step.sum() > 0 else 0.0
        if self.gpu_idle_ms:
            idle = np.asarray([np.nan if v is None else v for v in self.gpu_idle_ms])[mask]
            known = ~np.isnan(idle)
            if known.any():
                row["gpu_idle_ms"] = float(idle[known].mean())
                row["gpu_idle_fraction"] = (float(idle[known].sum() / step[known].sum())
                                            if step[known].sum() > 0 else 0.0)
        if self.gpu_busy_ms:
            busy = np.asarray([np.nan if v is None else v for v in self.gpu_busy_ms])[mask]
            if (~np.isnan(busy)).any():
                row["gpu_busy_ms"] = float(np.nanmean(busy))
        return row
