"""StartGate: the other ranks wait, in the rendezvous store, until rank 0 has its requests ready.

Why: rank 0 alone reads and tokenizes the prompts (minutes for a large file) while the others
would sit in the first plan broadcast, whose gloo timeout is dist_timeout_s. Waiting on a store
key instead has no such limit, and the watchdog still ends the wait if rank 0 posts a fault.
"""
from __future__ import annotations

import time

REFUSED = "refused:"  # the key's value when rank 0 refused the job's requests (a user error) instead



class StartGate:
    def __init__(self, store, key: str, poll_s: float = 0.05) -> None:
        self.store = store
        self.key = key
        self.poll_s = poll_s

    def open(self) -> None:
        """Rank 0: the requests are ready, the first plan follows."""
        self.store.set(self.key, "1")

    def refuse(self, message: str) -> None:
        """Rank 0: no plan follows; the waiting ranks leave with this one-line user error (exit 2)."""
        self.store.set(self.key, REFUSED + message)

    def wait(self) -> str | None:
        """Other ranks: return once rank 0 opened the gate: None, or rank 0's refusal message (raises if
        the store goes away)."""
        while not self.store.check([self.key]):
            time.sleep(self.poll_s)
        value = self.store.get(self.key).decode("utf-8", errors="replace")
        return value[len(REFUSED):] if value.startswith(REFUSED) else None
