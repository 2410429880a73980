"""The Hydra job's side of the data-parallel hand-out (spmd_engine/replica_dispatch.py): a replica's
finished requests travel to rank 0 as outputs.jsonl rows, counted into the replica's RunningStats.

Why apart from the hand-out itself: `LLM.generate` hands out requests the same way, and the API
stands without the job's rows and metrics.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from spmd_engine.core.requests import RequestOutput
from spmd_engine.job.metrics import RunningStats
from spmd_engine.replica_dispatch import DISPATCH_POLL_S, ChunkBoard, ClaimedRequests, Dispatcher, OutputPoster

__all__ = ["DISPATCH_POLL_S", "ChunkBoard", "ClaimedRequests", "Dispatcher", "RowPoster"]


@dataclass
class RowPoster(OutputPoster):
    """A replica leader other than rank 0: each finished request's row goes to rank 0 through the board."""

    stats: RunningStats = field(default_factory=RunningStats)

    def __call__(self, out: RequestOutput) -> None:
        self.stats.add(out)
        super().__call__(out)
