from spmd_engine.faults.fault_board import ERROR, LOST, PEER, SIGNAL, TIMEOUT, FaultEntry
from spmd_engine.faults.fault_summary import summarize_faults


def e(rank, kind, *, step=3, seconds=0.1, timeout_s=10.0, in_collective=True,
      where="models/parallel.py:43 in all_reduce", message=""):
    return FaultEntry(rank, kind, step, "step", seconds, timeout_s, where, in_collective, message)


def test_an_error_wins_and_names_rank_step_and_reason():
    entries = {0: e(0, LOST, message="RuntimeError: Connection closed by peer"),
               1: e(1, ERROR, in_collective=False, message="InjectedFault: boom"),
               2: e(2, ERROR, message="ValueError: x")}
    line = summarize_faults(entries, 4, entries[0])
    assert line == "rank 1 failed at step 3: InjectedFault: boom (rank 2 failed too)"


def test_the_rank_outside_the_collective_is_the_hung_one():
    entries = {0: e(0, TIMEOUT, seconds=10.2),
               1: e(1, PEER, seconds=9.9, in_collective=False,
                    where="spmd_engine/faults/injection.py:46 in before_step")}
    line = summarize_faults(entries, 2, entries[0])
    assert line.startswith("rank 1 hung at step 3: no progress for 9.9 s (dist_timeout_s=10) at "
                           "spmd_engine/faults/injection.py:46 in before_step")
    # the gloo timeout can beat the watchdog: a LOST entry works the same
    entries[0] = e(0, LOST, message="RuntimeError: Timed out")
    assert summarize_faults(entries, 2, entries[0]).startswith("rank 1 hung at step 3")


def test_a_rank_just_between_collectives_is_not_hung():
    entries = {0: e(0, TIMEOUT, seconds=10.2), 1: e(1, PEER, seconds=0.3, in_collective=False)}
    line = summarize_faults(entries, 2, entries[0])
    assert line.startswith("no progress at step 3 for 10.2 s") and "rank 0 at models/parallel.py:43" in line


def test_silent_ranks_died():
    entries = {0: e(0, LOST, message="RuntimeError: Connection closed by peer")}
    assert summarize_faults(entries, 3, entries[0]) == \
        "ranks 1, 2 stopped at step 3 without reporting an error (killed, exited or its host failed)"
    own = e(1, LOST, step=None)
    assert summarize_faults({1: own}, 2, own, store_lost=True) == (
        "rank 0 stopped during start-up without reporting an error (its process group connections and the "
        "rendezvous store it hosts are gone)")


def test_signals_and_plain_network_failures():
    entries = {0: e(0, SIGNAL, message="SIGINT"), 1: e(1, SIGNAL, message="SIGINT")}
    line = summarize_faults(entries, 2, entries[0])
    assert line.startswith("ranks 0, 1 received SIGINT at step 3; stopped every rank")
    single = e(0, SIGNAL, message="SIGTERM")
    assert summarize_faults({0: single}, 1, single).startswith("the job received SIGTERM at step 3")
    lost = {0: e(0, LOST, message="RuntimeError: reset"), 1: e(1, LOST, message="RuntimeError: reset")}
    assert summarize_faults(lost, 2, lost[0]) == "the process group failed at step 3 on ranks 0, 1: RuntimeError: reset"


def test_single_process_hang_has_no_other_ranks():
    own = e(0, TIMEOUT, seconds=10.5, in_collective=False, where="spmd_engine/executor/model_runner.py:9 in execute")
    assert summarize_faults({0: own}, 1, own) == (
        "rank 0 hung at step 3: no progress for 10.5 s (dist_timeout_s=10) at "
        "spmd_engine/executor/model_runner.py:9 in execute")


def test_a_silent_rank_is_named_with_where_its_watchdog_last_saw_it_in_this_step():
    own = e(0, LOST, step=5, message="rank 1 sent no heartbeat for 2.0 s")
    seen = {1: {"step": 5, "phase": "step", "where": "spmd_engine/faults/injection.py:66 in compute_for",
                "in_collective": False}}
    assert summarize_faults({0: own}, 2, own, last_seen=seen) == (
        "rank 1 stopped at step 5 without reporting an error (killed, exited or its host failed); "
        "last seen at step 5 at spmd_engine/faults/injection.py:66 in compute_for")
    stale = {1: {"step": None, "phase": "startup", "where": "spmd_engine/engine.py:60 in agreed",
                 "in_collective": True}}
    assert summarize_faults({0: own}, 2, own, last_seen=stale).endswith("(killed, exited or its host failed)")
