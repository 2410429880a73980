import threading
import time

import torch.distributed as dist

from spmd_engine.faults.start_gate import StartGate


def test_waiters_pass_only_once_rank0_opens():
    store = dist.HashStore()
    gate = StartGate(store, "gate/0/1", poll_s=0.01)
    passed = threading.Event()
    waiter = threading.Thread(target=lambda: (gate.wait(), passed.set()))
    waiter.start()
    time.sleep(0.1)
    assert not passed.is_set()
    StartGate(store, "gate/0/1").open()
    waiter.join(5)
    assert passed.is_set()
    assert not StartGate(store, "gate/0/2").store.check(["gate/0/2"])  # the next job's gate is still shut


def test_a_refusal_reaches_the_waiters_as_its_message():
    store = dist.HashStore()
    StartGate(store, "gate/0/1").refuse("resume=true: outputs.jsonl row 3 is not this job's request 3")
    assert StartGate(store, "gate/0/1", poll_s=0.01).wait() == \
        "resume=true: outputs.jsonl row 3 is not this job's request 3"
    StartGate(store, "gate/0/2").open()
    assert StartGate(store, "gate/0/2", poll_s=0.01).wait() is None
