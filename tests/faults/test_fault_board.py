import socket

import torch.distributed as dist

from spmd_engine.faults.fault_board import ERROR, PEER, FaultBoard, FaultEntry


def entry(rank, kind=ERROR, **kw):
    fields = dict(step=3, phase="step", seconds=0.5, timeout_s=60.0, where="spmd_engine/x.py:1 in f",
                  in_collective=False, message="boom")
    fields.update(kw)
    return FaultEntry(rank, kind, **fields)


def test_entries_round_trip_and_the_posted_flag():
    board = FaultBoard(dist.HashStore(), world_size=3, namespace="7")
    assert not board.has_posts() and board.entries() == {}
    board.post(entry(2))
    board.post(entry(0, PEER, in_collective=True, step=None, timeout_s=None))
    assert board.has_posts() and board.has_entry(2) and not board.has_entry(1)
    assert board.entries() == {0: entry(0, PEER, in_collective=True, step=None, timeout_s=None), 2: entry(2)}


def test_namespaces_keep_restarts_apart():
    store = dist.HashStore()
    FaultBoard(store, 2, namespace="0").post(entry(1))
    assert not FaultBoard(store, 2, namespace="1").has_posts()


def test_one_reporter_and_acks():
    board = FaultBoard(dist.HashStore(), world_size=3)
    assert [board.claim_report() for _ in range(3)] == [True, False, False]
    assert not board.is_reported()
    board.mark_reported()
    assert board.is_reported()
    assert board.all_acked([]) and not board.all_acked([1, 2])
    board.ack(1)
    board.ack(2)
    assert board.all_acked([1, 2])


def test_reachable_probes_the_store_address_without_a_store_call():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        open_port = s.getsockname()[1]
        assert FaultBoard(None, 2, address=("127.0.0.1", open_port)).reachable()
    assert not FaultBoard(None, 2, address=("127.0.0.1", open_port)).reachable(timeout_s=0.5)
    assert FaultBoard(None, 2).reachable()  # no address known: assume so
