"""The stop protocol of two ranks' Supervisors sharing one store, in threads of this process."""
import signal
import threading

import torch.distributed as dist

from spmd_engine.distributed import RankInfo
from spmd_engine.faults.fault_board import FaultBoard
from spmd_engine.faults.injection import FaultInjector, InjectedFault
from spmd_engine.faults.supervisor import Supervisor


def supervisors(world=2, grace_s=2.0, store=None):
    store = store or dist.HashStore()
    codes: dict[int, list[int]] = {r: [] for r in range(world)}
    sups = []
    for rank in range(world):
        sup = Supervisor(RankInfo(rank, world, rank, "127.0.0.1", 0, "torchrun"), grace_s=grace_s,
                         exit_fn=codes[rank].append)
        sup.board = FaultBoard(store, world)
        sup.progress.timeout_s = 60.0
        sup.progress.step(3)
        sups.append(sup)
    return sups, codes


def run_all(*calls):
    threads = [threading.Thread(target=fn) for fn in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)


def raised() -> InjectedFault:
    try:
        FaultInjector(rank=1, step=3, kind="raise").before_step(3)
    except InjectedFault as exc:
        return exc


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error: ")]


def test_a_raising_rank_is_reported_once_by_rank0(capsys):
    (r0, r1), codes = supervisors()
    run_all(lambda: r1.fail(raised()), r0.on_peer_post)  # rank 0's watchdog saw the post
    err = capsys.readouterr().err
    assert error_lines(err) == ["error: rank 1 failed at step 3: InjectedFault: injected fault on rank 1 at step 3"]
    assert err.count("Traceback") == 1  # the origin's own traceback
    assert codes == {0: [1], 1: [1]}


def test_a_silent_rank0_is_reported_by_one_survivor(capsys):
    (r0, r1, r2), codes = supervisors(world=3, grace_s=0.3)
    lost = dist.DistNetworkError("Connection closed by peer")  # what a collective raises when a peer dies
    run_all(lambda: r1.fail(lost), lambda: r2.fail(lost))
    assert error_lines(capsys.readouterr().err) == [
        "error: rank 0 stopped at step 3 without reporting an error (killed, exited or its host failed)"]
    assert codes == {0: [], 1: [1], 2: [1]}


def test_without_the_store_a_survivor_reports_alone(capsys):
    (_, r1), codes = supervisors()
    r1.board = None  # rank 0 hosted it and is gone
    r1.fail(dist.DistNetworkError("Connection closed by peer"))
    assert error_lines(capsys.readouterr().err)[0].startswith("error: rank 0 stopped at step 3 without reporting")
    assert codes[1] == [1]


def test_signals_exit_128_plus_signum_and_a_second_trigger_is_ignored(capsys):
    sup = Supervisor(RankInfo(0, 1, 0, "127.0.0.1", 0, "single"), exit_fn=(codes := []).append)
    sup.progress.step(9)
    run_all(lambda: sup.on_signal(signal.SIGINT))
    run_all(lambda: sup.on_signal(signal.SIGTERM))
    assert error_lines(capsys.readouterr().err) == [
        "error: the job received SIGINT at step 9; stopped every rank (finished requests are kept in outputs.jsonl; "
        "resume=true continues)"]
    assert codes == [130]


def test_losing_the_store_while_idle_is_a_normal_end():
    (_, r1), codes = supervisors()
    r1.progress.idle()  # the stop plan came; rank 0 (the store's host) may exit first
    r1.on_board_lost(ConnectionResetError("gone"))
    assert codes[1] == []


def test_a_stop_signal_while_leaving_on_an_agreed_user_error_keeps_its_exit_code(capsys):
    """torchrun SIGTERMs the ranks still running once one rank has exited: a rank already leaving with
    the agreed code 2 must not turn into a signal report (exit 143) in torchrun's summary."""
    sup = Supervisor(RankInfo(1, 2, 1, "127.0.0.1", 0, "torchrun"), exit_fn=(codes := []).append)
    sup.leaving(2)
    sup.on_signal(signal.SIGTERM)
    assert codes == [2]
    assert "SIGTERM" not in capsys.readouterr().err
