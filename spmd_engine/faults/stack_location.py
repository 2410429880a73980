"""Where a thread (or an exception) is, in one short line, and whether it waits in a collective.

Why: when a step times out, the rank that is *not* inside a torch.distributed call is the one the
others are waiting for; naming its file and line is most of the diagnosis.
"""
from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

REPO_ROOT = str(Path(__file__).resolve().parents[2]) + os.sep
OWN_PACKAGES = ("spmd_engine", "models", "kernels")
COLLECTIVE_MARK = os.sep.join(("torch", "distributed", ""))


@dataclass(frozen=True)
class Location:
    where: str  # "spmd_engine/faults/injection.py:52 in before_step" (the innermost frame of our packages)
    in_collective: bool  # some frame is inside torch.distributed


def _ours(filename: str) -> bool:
    return filename.startswith(REPO_ROOT) and filename[len(REPO_ROOT):].split(os.sep, 1)[0] in OWN_PACKAGES


def locate(frames: list[tuple[str, int, str]]) -> Location:
    """`frames` as (filename, line, function), outermost first."""
    in_collective = any(COLLECTIVE_MARK in filename for filename, _, _ in frames)
    for filename, line, function in reversed(frames):
        if _ours(filename):
            return Location(f"{filename[len(REPO_ROOT):]}:{line} in {function}", in_collective)
    if frames:
        filename, line, function = frames[-1]
        return Location(f"{os.path.basename(filename)}:{line} in {function}", in_collective)
    return Location("unknown", in_collective)


def _frame_list(frame: FrameType | None) -> list[tuple[str, int, str]]:
    frames = []
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames[::-1]


def thread_location(thread: threading.Thread) -> Location:
    """Where `thread` is now (call it from another thread)."""
    return locate(_frame_list(sys._current_frames().get(thread.ident)))


def thread_snapshot(thread: threading.Thread) -> tuple[Location, int]:
    """Where `thread` is now and a key of its whole stack (every frame's file and line): a key that
    keeps changing means the thread moves through code; one that stands still, that it waits or spins."""
    frames = _frame_list(sys._current_frames().get(thread.ident))
    return locate(frames), hash(tuple(frames))


def exception_location(exc: BaseException) -> Location:
    """Where `exc` was raised."""
    frames = []
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    return locate(frames)
