"""FaultBoard: each stopping rank's one-line account, kept in the job's rendezvous store.

Why: a rank that fails can't tell the others through the process group (it is broken or busy),
but the TCPStore every rank already rendezvoused on still works, so a survivor can learn who
failed and why, and one rank can report it once.
"""
from __future__ import annotations

import datetime
import json
import socket
from dataclasses import asdict, dataclass

ERROR = "error"  # this rank's own code raised
LOST = "lost"  # a collective of this rank failed (a peer died or the network broke)
TIMEOUT = "timeout"  # no rank moved (see watchdog.py) for more than dist_timeout_s
SIGNAL = "signal"  # this rank got SIGINT or SIGTERM
PEER = "peer"  # this rank stops because another rank posted
KINDS = (ERROR, LOST, TIMEOUT, SIGNAL, PEER)


@dataclass(frozen=True)
class FaultEntry:
    rank: int
    kind: str  # one of KINDS
    step: int | None  # the rank's step (None: during start-up)
    phase: str  # progress phase name at the time
    seconds: float  # how long the rank had not moved (watchdog) in that phase, at most the phase's age
    timeout_s: float | None  # the phase's timeout (None: not watched, e.g. start-up)
    where: str  # innermost engine frame of the main thread (or of the exception)
    in_collective: bool  # waiting on the peers: inside torch.distributed, or on an issued forward
    message: str = ""  # one line: the exception, the signal name, the timeout

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "FaultEntry":
        return cls(**json.loads(text))


class FaultBoard:
    """Posts under `spmd_engine/fault/<namespace>/`; every method may raise when the store is gone."""

    def __init__(self, store, world_size: int, namespace: str = "0", address: tuple[str, int] | None = None) -> None:
        self.store = store
        self.world_size = world_size
        self.prefix = f"spmd_engine/fault/{namespace}/"
        self.address = address  # the store server's (host, port), for `reachable`

    def reachable(self, timeout_s: float = 1.0) -> bool:
        """A plain TCP connect to the store server: a dead host is found without a store call (whose
        failure torch logs with a C++ stack)."""
        if self.address is None:
            return True
        try:
            socket.create_connection(self.address, timeout=timeout_s).close()
        except OSError:
            return False
        return True

    @classmethod
    def connect(cls, host: str, port: int, world_size: int, timeout_s: float, namespace: str = "0") -> "FaultBoard":
        """A client of its own to the rendezvous store, so the watchdog thread never shares a socket."""
        import torch.distributed as dist

        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        return cls(store, world_size, namespace, (host, port))

    def _key(self, name: str) -> str:
        return self.prefix + name

    def post(self, entry: FaultEntry) -> None:
        self.store.set(self._key(f"rank{entry.rank}"), entry.to_json())
        self.store.set(self._key("posted"), "1")

    def beat(self, rank: int) -> None:
        """`rank` is alive (its watchdog thread runs): one more heartbeat."""
        self.store.add(self._key(f"beat{rank}"), 1)

    def beats(self) -> list[int]:
        """Every rank's heartbeat count so far (0 before its first)."""
        return [self.store.add(self._key(f"beat{r}"), 0) for r in range(self.world_size)]

    def moved(self, rank: int) -> None:
        """`rank`'s main thread made progress (a new phase, or CPU spent outside collectives)."""
        self.store.add(self._key(f"move{rank}"), 1)

    def moves(self) -> list[int]:
        """Every rank's progress count so far (0 before its first)."""
        return [self.store.add(self._key(f"move{r}"), 0) for r in range(self.world_size)]

    def publish(self, rank: int, step: int | None, phase: str, where: str, in_collective: bool) -> None:
        """Where `rank`'s main thread is now: what the report says of it if it freezes or dies."""
        self.store.set(self._key(f"seen{rank}"), json.dumps({"step": step, "phase": phase, "where": where,
                                                              "in_collective": in_collective}))

    def last_seen(self, rank: int) -> dict | None:
        key = self._key(f"seen{rank}")
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def has_posts(self) -> bool:
        return self.store.check([self._key("posted")])

    def has_entry(self, rank: int) -> bool:
        return self.store.check([self._key(f"rank{rank}")])

    def entries(self) -> dict[int, FaultEntry]:
        found = {}
        for rank in range(self.world_size):
            key = self._key(f"rank{rank}")
            if self.store.check([key]):
                found[rank] = FaultEntry.from_json(self.store.get(key))
        return found

    def claim_report(self) -> bool:
        """True for exactly one caller: the rank that reports when rank 0 cannot."""
        return self.store.add(self._key("reporter"), 1) == 1

    def mark_reported(self) -> None:
        self.store.set(self._key("reported"), "1")

    def is_reported(self) -> bool:
        return self.store.check([self._key("reported")])

    def ack(self, rank: int) -> None:
        """`rank` saw the report and exits: the store's host may go now."""
        self.store.set(self._key(f"ack{rank}"), "1")

    def all_acked(self, ranks: list[int]) -> bool:
        return not ranks or self.store.check([self._key(f"ack{r}") for r in ranks])
