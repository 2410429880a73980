import threading
import time

import torch.distributed as dist

from spmd_engine.faults.injection import FaultInjector, InjectedFault
from spmd_engine.faults.stack_location import REPO_ROOT, exception_location, locate, thread_location


def test_exception_location_is_the_innermost_engine_frame():
    try:
        FaultInjector(rank=0, step=1, kind="raise").before_step(1)
    except InjectedFault as exc:
        where = exception_location(exc)
    assert where.where.startswith("spmd_engine/faults/injection.py:") and where.where.endswith("in before_step")
    assert not where.in_collective


def test_a_stack_through_torch_distributed_is_in_a_collective():
    frames = [(REPO_ROOT + "models/parallel.py", 43, "all_reduce"),
              (dist.__file__.replace("__init__.py", "distributed_c10d.py"), 3252, "all_reduce")]
    where = locate(frames)
    assert where.in_collective and where.where == "models/parallel.py:43 in all_reduce"
    assert locate([("/usr/lib/python3/x.py", 3, "f")]).where == "x.py:3 in f"
    assert locate([]).where == "unknown"


def test_thread_location_sees_another_thread():
    started, release = threading.Event(), threading.Event()

    def park():  # this file is not in an engine package: the innermost frame is reported
        started.set()
        release.wait(5)

    t = threading.Thread(target=park)
    t.start()
    started.wait(5)
    time.sleep(0.05)
    try:
        where = thread_location(t)
    finally:
        release.set()
        t.join()
    assert "in wait" in where.where and not where.in_collective
