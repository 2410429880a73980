import subprocess
import sys
import textwrap
import threading
import time

import torch.distributed as dist

from spmd_engine.faults.fault_board import ERROR, FaultBoard, FaultEntry
from spmd_engine.faults.injection import compute_for
from spmd_engine.faults.progress import StepProgress
from spmd_engine.faults.stack_location import REPO_ROOT, Location
from spmd_engine.faults.watchdog import MainSample, Watchdog, WatchdogCallbacks, main_thread_probe

COMPUTING = Location("models/qwen3.py:40 in forward", False)
IN_COLLECTIVE = Location("models/parallel.py:43 in all_reduce", True)
SLEEPING = Location("spmd_engine/faults/injection.py:60 in before_step", False)


class Calls:
    def __init__(self):
        self.seen = []

    def callbacks(self):
        return WatchdogCallbacks(lambda phase, seconds: self.seen.append(("timeout", phase.step)),
                                 lambda: self.seen.append(("peer",)),
                                 lambda exc: self.seen.append(("lost", type(exc).__name__)),
                                 lambda rank, seconds: self.seen.append(("silent", rank)))


class FakeMain:
    """The main thread as the watchdog samples it: `computing` burns CPU at full speed between polls."""

    def __init__(self, where=COMPUTING):
        self.where = where
        self.cpu = 0.0
        self.last = time.monotonic()
        self.stack = 0

    def __call__(self) -> MainSample:
        now = time.monotonic()
        if self.where is COMPUTING:  # through one op after another
            self.cpu += now - self.last
            self.stack += 1
        self.last = now
        return MainSample(self.cpu, self.where, self.stack)


class DeadStore:
    def __getattr__(self, name):
        def fail(*args):
            raise ConnectionResetError("store host is gone")
        return fail


class Both:
    """Two ranks' watchdogs polled in turn."""

    def __init__(self, *dogs):
        self.dogs = dogs

    def check_once(self):
        return any([dog.check_once() for dog in self.dogs])


def poll_for(dog, seconds, every=0.02):
    """Poll `dog` for `seconds`; True as soon as it fires."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if dog.check_once():
            return True
        time.sleep(every)
    return False


def test_a_stalled_step_fires_once_a_computing_one_never_and_an_idle_rank_never():
    progress, calls, main = StepProgress(timeout_s=0.1), Calls(), FakeMain()
    dog = Watchdog(progress, None, calls.callbacks(), probe=main)
    progress.step(4)
    assert not poll_for(dog, 0.4)  # four timeouts long, but computing all along: a slow step
    main.where = SLEEPING  # no CPU, outside any collective: stuck
    assert poll_for(dog, 0.5) and calls.seen == [("timeout", 4)]
    assert dog.stalled_s() > 0.1
    progress.idle()
    calls.seen.clear()
    assert not poll_for(dog, 0.3) and calls.seen == []


def test_cpu_spent_inside_a_collective_is_waiting_not_progress():
    progress, calls, main = StepProgress(timeout_s=0.1), Calls(), FakeMain(IN_COLLECTIVE)
    dog = Watchdog(progress, None, calls.callbacks(), probe=main)
    progress.step(2)
    main.cpu += 100.0  # e.g. a host spinning on a GPU wait inside the collective
    main.stack += 1
    assert poll_for(dog, 0.5) and calls.seen == [("timeout", 2)]


def test_cpu_spent_in_one_place_is_one_long_op_on_a_cpu_device_and_a_spin_with_cuda():
    one_place = Location("spmd_engine/executor/token_readback.py:26 in numpy", False)  # one op, or a CUDA event wait
    for cuda, fires in ((False, False), (True, True)):
        progress, calls = StepProgress(timeout_s=0.1), Calls()
        dog = Watchdog(progress, None, calls.callbacks(), probe=lambda: MainSample(time.monotonic(), one_place, 7),
                       spin_waits=lambda: cuda)  # noqa: B023 - used within the iteration
        progress.step(3)
        assert poll_for(dog, 0.5) == fires and calls.seen == ([("timeout", 3)] if fires else [])


def test_every_rank_computing_a_long_step_is_progress_a_job_where_nothing_moves_is_not():
    store = dist.HashStore()
    calls0, calls1 = Calls(), Calls()
    p0, p1 = StepProgress(timeout_s=0.3), StepProgress(timeout_s=0.3)
    m0, m1 = FakeMain(), FakeMain()
    kw = dict(observe_after_s=0.05, stale_s=10.0)
    d0 = Watchdog(p0, FaultBoard(store, 2), calls0.callbacks(), rank=0, probe=m0, **kw)
    d1 = Watchdog(p1, FaultBoard(store, 2), calls1.callbacks(), rank=1, probe=m1, **kw)
    both = Both(d0, d1)
    p0.step(7), p1.step(7)
    assert not poll_for(both, 1.0)  # both compute: more than three timeouts long
    m0.where = IN_COLLECTIVE  # rank 0 waits for rank 1, which still computes: fine
    assert not poll_for(both, 1.0)
    m1.where = SLEEPING  # rank 1 stops outside the collective rank 0 waits in: nothing moves
    assert poll_for(both, 1.5)
    assert ("timeout", 7) in calls0.seen + calls1.seen
    assert FaultBoard(store, 2).last_seen(1)["where"] == SLEEPING.where


def test_the_real_probe_tells_a_computing_main_thread_from_a_sleeping_one():
    probe, deltas, stacks = main_thread_probe(), [], []
    compute_for(0.05)  # one-time set-up (imports, torch's thread pools) before the window: it holds one stack

    def measure():
        first = probe().cpu_s
        keys = set()
        for _ in range(6):
            time.sleep(0.05)
            keys.add(probe().stack_key)
        deltas.append(probe().cpu_s - first)
        stacks.append(len(keys))

    computing = threading.Thread(target=measure)
    computing.start()
    compute_for(0.6)  # the whole window: the main thread computes
    computing.join()
    sleeping = threading.Thread(target=measure)
    sleeping.start()
    sleeping.join()  # the whole window: it sleeps in join
    assert deltas[0] > 0.05 and deltas[1] < 0.02, deltas
    assert stacks[0] > 1 and stacks[1] == 1, stacks  # computing moves through code; sleeping stands still


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
    dog = Watchdog(progress, FaultBoard(store, 2), calls.callbacks(), rank=0, observe_after_s=0.3, stale_s=0.2,
                   probe=FakeMain(IN_COLLECTIVE))
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
    dog = Watchdog(progress, None, calls.callbacks(), poll_s=0.02, probe=FakeMain(SLEEPING)).start()
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
        from spmd_engine.faults.progress import StepProgress
        from spmd_engine.faults.watchdog import Watchdog, WatchdogCallbacks
        progress = StepProgress(timeout_s=1.0)
        dog = Watchdog(progress, None, WatchdogCallbacks(lambda p, s: print("watchdog ran"), None, None),
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
