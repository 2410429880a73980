"""Ranks other than 0 wait for the rendezvous store's port for at most startup_timeout_s."""
import socket
import time

import pytest

from spmd_engine.distributed import RankInfo, RendezvousUnreachable, wait_for_rendezvous
from spmd_engine.faults.supervisor import Supervisor
from tests.faults.launches import free_port


def rank(r: int, port: int) -> RankInfo:
    return RankInfo(r, 3, r, "127.0.0.1", port, "torchrun")


def test_a_listening_store_passes_at_once_and_rank0_never_waits():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        t0 = time.monotonic()
        wait_for_rendezvous(rank(1, server.getsockname()[1]), timeout_s=5)
        assert time.monotonic() - t0 < 1
    wait_for_rendezvous(rank(0, free_port()), timeout_s=0)  # it hosts the store


def test_nobody_listening_is_one_line_after_the_limit(capsys):
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(RendezvousUnreachable) as caught:
        wait_for_rendezvous(rank(2, port), timeout_s=0.6, poll_s=0.05)
    assert 0.5 <= time.monotonic() - t0 < 3
    assert str(caught.value) == (f"rank 2: nothing answered at the rendezvous address 127.0.0.1:{port} within "
                                 "startup_timeout_s=0.6 (rank 0 did not start, or stopped before the rendezvous)")
    codes = []
    Supervisor(rank(2, port), exit_fn=codes.append).fail(caught.value)
    err = capsys.readouterr().err
    assert codes == [1] and err.strip() == f"error: {caught.value}" and "Traceback" not in err
