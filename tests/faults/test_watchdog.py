import subprocess
import sys
import textwrap
import time

import torch.distributed as dist

from spmd_engine.fault_board import ERROR, FaultBoard, FaultEntry
from spmd_engine.progress import StepProgress
from spmd_engine.stack_location import REPO_ROOT
from spmd_engine.watchdog import Watchdog, WatchdogCallbacks


class Calls:
    def __init__(self):
        self.seen = []

    def callbacks(self):
        return WatchdogCallbacks(lambda phase: self.seen.append(("timeout", phase.step)),
                                 lambda: self.seen.append(("peer",)),
                                 lambda exc: self.seen.append(("lost", type(exc).__name__)),
                                 lambda rank, seconds: self.seen.append(("silent", rank)))


class DeadStore:
    def __getattr__(self, name):
        def fail(*args):
            raise ConnectionResetError("store host is gone")
        return fail


def test_a_late_step_fires_once_and_an_idle_rank_never():
    progress, calls = StepProgress(timeout_s=0.05), Calls()
    dog = Watchdog(progress, None, calls.callbacks())
    progress.step(4)
    assert not dog.check_once()
    time.sleep(0.1)
    assert dog.check_once() and calls.seen == [("timeout", 4)]
    progress.idle()
    calls.seen.clear()
    assert not dog.check_once() and calls.seen == []


def test_another_ranks_post_or_a_dead_store_stop_this_rank():
    board, calls = FaultBoard(dist.HashStore(), 2), Calls()
    dog = Watchdog(StepProgress(timeout_s=60), board, calls.callbacks())
    assert not dog.check_once()
    board.post(FaultEntry(1, ERROR, 3, "step", 0.1, 60.0, "x", False, "boom"))
    assert dog.check_once() and calls.seen == [("peer",)]
    dead = Watchdog(StepProgress(timeout_s=60), FaultBoard(DeadStore(), 2), calls.callbacks())
    assert dead.check_once() and calls.seen[-1] == ("lost", "ConnectionResetError")


def test_a_peer_whose_heartbeat_stops_is_found_while_this_step_is_slow():
    store, calls = dist.HashStore(), Calls()
    peer = FaultBoard(store, 2)
    progress = StepProgress(timeout_s=60)
    dog = Watchdog(progress, FaultBoard(store, 2), calls.callbacks(), rank=0, observe_after_s=0.3, stale_s=0.2)
    progress.step(3)
    peer.beat(1)
    assert not dog.check_once()  # a fast step: the peers are not even looked at
    time.sleep(0.3)
    assert not dog.check_once()  # first look at the peer's count
    peer.beat(1)
    time.sleep(0.25)
    assert not dog.check_once()  # it moved: alive
    time.sleep(0.25)
    assert dog.check_once() and calls.seen == [("silent", 1)]
    assert FaultBoard(store, 2).beats()[0] == 4  # this rank beat on every poll


def test_the_thread_polls_until_stopped():
    progress, calls = StepProgress(timeout_s=0.1), Calls()
    dog = Watchdog(progress, None, calls.callbacks(), poll_s=0.02).start()
    progress.step(1)
    deadline = time.monotonic() + 5
    while not calls.seen and time.monotonic() < deadline:
        time.sleep(0.02)
    dog.stop()
    assert calls.seen == [("timeout", 1)]


def test_deadman_ends_a_process_whose_main_thread_holds_the_gil():
    """The watchdog thread can't run while C code holds the GIL; faulthandler's timer still fires."""
    script = textwrap.dedent(f"""
        import re, sys, time
        sys.path.insert(0, {REPO_ROOT!r})
        from spmd_engine.progress import StepProgress
        from spmd_engine.watchdog import Watchdog, WatchdogCallbacks
        progress = StepProgress(timeout_s=1.0)
        dog = Watchdog(progress, None, WatchdogCallbacks(lambda p: print("watchdog ran"), None, None),
                       poll_s=0.05, deadman_margin_s=0.5).start()
        progress.step(0)
        time.sleep(0.3)
        re.match(r"(a+)+$", "a" * 40 + "b")  # catastrophic backtracking, GIL held throughout
        print("regex returned")
    """)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert time.monotonic() - t0 < 30
    assert "regex returned" not in proc.stdout and "watchdog ran" not in proc.stdout
    assert "Timeout" in proc.stderr and "most recent call first" in proc.stderr
