"""The one line that says why a distributed job stopped, from whatever the ranks managed to post.

Why: after a fault every rank sees only a symptom (a closed connection, a timeout, a signal);
the cause is the rank that raised, the one stuck outside the collective the others wait in, or
the one that went silent, in that order of certainty.
"""
from __future__ import annotations

from spmd_engine.faults.fault_board import ERROR, LOST, SIGNAL, TIMEOUT, FaultEntry

RESUME_HINT = "finished requests are kept in outputs.jsonl; resume=true continues"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _at(step: int | None) -> str:
    return "during start-up" if step is None else f"at step {step}"


def is_stuck(entry: FaultEntry) -> bool:
    """Not inside a collective, yet at least half the timeout into a watched phase: the others wait for it."""
    return (entry.timeout_s is not None and not entry.in_collective
            and entry.seconds >= 0.5 * entry.timeout_s)


def _last_seen(silent: list[int], last_seen: dict[int, dict] | None, step: int | None) -> str:
    """Where the first silent rank's watchdog last saw its main thread (it can't post any more); only
    if that was in the reporter's `step` (a fast rank's watchdog may not have polled since start-up)."""
    seen = (last_seen or {}).get(silent[0]) if silent else None
    if not seen or seen.get("step") is None or seen.get("step") != step:
        return ""
    who = f"rank {silent[0]} " if len(silent) > 1 else ""
    waiting = " waiting in a collective" if seen.get("in_collective") else ""
    return f"; {who}last seen {_at(seen.get('step'))} at {seen.get('where')}{waiting}"


def summarize_faults(entries: dict[int, FaultEntry], world_size: int, reporter: FaultEntry,
                     store_lost: bool = False, last_seen: dict[int, dict] | None = None) -> str:
    """One line naming the failing rank(s) and the reason. `reporter` is the calling rank's own entry
    (its step dates a silent death); `store_lost`: the rendezvous store, hosted by rank 0, is gone;
    `last_seen`: rank -> the location its watchdog last published (FaultBoard.last_seen)."""
    ordered = [entries[r] for r in sorted(entries)]
    of_kind = {kind: [e for e in ordered if e.kind == kind] for kind in (ERROR, LOST, TIMEOUT, SIGNAL)}
    silent = [r for r in range(world_size) if r not in entries]
    if store_lost:
        silent = [0] if 0 not in entries else []
    stuck = [e for e in ordered if is_stuck(e)]

    if of_kind[ERROR]:
        first, others = of_kind[ERROR][0], [e.rank for e in of_kind[ERROR][1:]]
        also = f" ({_ranks(others)} failed too)" if others else ""
        return f"rank {first.rank} failed {_at(first.step)}: {first.message}{also}"
    if stuck and (of_kind[TIMEOUT] or of_kind[LOST]):
        s = stuck[0]
        others = " while the other ranks waited in collectives" if world_size > 1 else ""
        return (f"rank {s.rank} hung {_at(s.step)}: no progress for {s.seconds:.1f} s "
                f"(dist_timeout_s={s.timeout_s:g}) at {s.where}{others}")
    if silent:
        how = ("its process group connections and the rendezvous store it hosts are gone" if store_lost
               else "killed, exited or its host failed")
        return (f"{_ranks(silent)} stopped {_at(reporter.step)} without reporting an error ({how})"
                f"{_last_seen(silent, last_seen, reporter.step)}")
    if of_kind[SIGNAL]:
        first = of_kind[SIGNAL][0]
        who = _ranks([e.rank for e in of_kind[SIGNAL]]) if world_size > 1 else "the job"
        return f"{who} received {first.message} {_at(first.step)}; stopped every rank ({RESUME_HINT})"
    if of_kind[TIMEOUT]:
        t = of_kind[TIMEOUT][0]
        return (f"no progress {_at(t.step)} for {t.seconds:.1f} s (dist_timeout_s={t.timeout_s:g}) with every "
                f"reporting rank waiting in a collective; rank {t.rank} at {t.where}")
    if of_kind[LOST]:
        first = of_kind[LOST][0]
        return (f"the process group failed {_at(first.step)} on {_ranks([e.rank for e in of_kind[LOST]])}: "
                f"{first.message}")
    return f"{_ranks([e.rank for e in ordered])} stopped {_at(reporter.step)} with no recorded cause"
