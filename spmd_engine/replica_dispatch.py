"""Data-parallel replicas share one request list through the rendezvous store: global rank 0 hands out
chunks of requests as replicas ask, and gathers every replica's finished requests (the Hydra job's rows
of the one outputs.jsonl, or `LLM.generate`'s outputs).

Why dynamic: a split up front leaves the replicas that drew short requests idle while one works
through long ones; a replica claims the next chunk only when its batch has room, so fast replicas
take more. A request is one unit (its completions stay on one replica). Store keys (under one
job's or one generate call's prefix):
  chunk/<k>     rank 0's k-th chunk (a pickled list of PromptRequest), deleted by its claimer
  chunks        the number of chunks, once the requests are exhausted
  ready         replica leaders at their first claim (`store.add`): claims start when all are there
  next_chunk    the claim counter (`store.add`): a replica leader's claim is the value it got, minus one
  out/<r>/<n>   replica r's n-th finished request (pickled, in the poster's `form`), deleted once taken
  done/<r>      replica r's end: its rows count and what its caller reports (the job: RunningStats, busy
                time, engine steps, bench work)
  finished      rank 0 has every row: every rank may leave
The store is the job's (trusted network, as the plans' pickles; docs/RELIABILITY.md).
"""
from __future__ import annotations

import pickle
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from spmd_engine.core.requests import NOT_YET, NotYet, PromptRequest, RequestOutput
from spmd_engine.faults.progress import StepProgress

POLL_S = 0.005  # a replica's wait for a chunk that is not there yet
DISPATCH_POLL_S = 0.01  # rank 0's dispatcher thread between rounds
LOOKAHEAD_PER_REPLICA = 2  # chunks published ahead of the claims, per replica
CHUNK_REQUESTS = 64  # requests read and tokenized at a time (dp=1), at most one chunk handed out (dp>1)


def chunk_size(total: int, replicas: int, max_num_seqs: int) -> int:
    """Requests per chunk: CHUNK_REQUESTS with one replica (reading granularity); with several, small
    enough that each replica takes ~8 chunks of the job and one chunk never outgrows a batch, so the
    replicas that finish first take the rest (the balance is as fine as one chunk)."""
    if replicas == 1:
        return CHUNK_REQUESTS
    return max(1, min(CHUNK_REQUESTS, max_num_seqs, -(-total // (8 * replicas))))


def chunked(items: Iterable[PromptRequest], size: int) -> Iterator[list[PromptRequest]]:
    items = iter(items)
    while chunk := list(islice(items, size)):
        yield chunk


@dataclass
class ChunkBoard:
    """One job's keys in the store (see the module docstring)."""

    store: object  # a torch.distributed Store
    prefix: str

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def publish(self, k: int, chunk: list[PromptRequest]) -> None:
        self.store.set(self._key(f"chunk/{k}"), pickle.dumps(chunk))

    def close(self, num_chunks: int) -> None:
        self.store.set(self._key("chunks"), str(num_chunks))

    def arrive_and_wait(self, replicas: int, alive: Callable[[], None] = lambda: None) -> None:
        """Wait for every replica's leader to reach its first claim: one that started early (rank 0
        opens the start gate, the others see it a poll later) would otherwise claim the first batch
        of every replica."""
        key = self._key("ready")
        self.store.add(key, 1)
        while self.store.add(key, 0) < replicas:
            alive()
            time.sleep(POLL_S)

    def claimed(self) -> int:
        return self.store.add(self._key("next_chunk"), 0)

    def claim_index(self) -> int:
        """Claim the next chunk index: it is this replica's from now on, published or not."""
        return self.store.add(self._key("next_chunk"), 1) - 1

    def take(self, k: int) -> list[PromptRequest] | None | NotYet:
        """Claimed chunk `k` if rank 0 published it, None if the job has fewer chunks, NOT_YET otherwise
        (no wait: one look at the store)."""
        key, end = self._key(f"chunk/{k}"), self._key("chunks")
        if self.store.check([key]):
            chunk = pickle.loads(self.store.get(key))
            self.store.delete_key(key)
            return chunk
        if self.store.check([end]) and k >= int(self.store.get(end)):
            return None
        return NOT_YET

    def wait_for(self, k: int, alive: Callable[[], None] = lambda: None) -> list[PromptRequest] | None:
        """Claimed chunk `k` (waiting for rank 0 to publish it), or None once every chunk is handed out.
        `alive()` runs while waiting and may raise (rank 0's dispatcher failed, a rank died)."""
        while (chunk := self.take(k)) is NOT_YET:
            alive()
            time.sleep(POLL_S)
        return chunk

    def claim(self, alive: Callable[[], None] = lambda: None) -> list[PromptRequest] | None:
        """The next chunk (waiting for rank 0 to publish it), or None once every chunk is handed out."""
        return self.wait_for(self.claim_index(), alive)

    def post_row(self, replica: int, n: int, row: object) -> None:
        self.store.set(self._key(f"out/{replica}/{n}"), pickle.dumps(row))

    def take_row(self, replica: int, n: int) -> object | None:
        key = self._key(f"out/{replica}/{n}")
        if not self.store.check([key]):
            return None
        row = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        return row

    def post_done(self, replica: int, rows: int, stats: Any = None, busy_s: float = 0.0, engine: dict | None = None,
                  bench: dict | None = None) -> None:
        """Replica `replica`'s end: its rows count and, for a job, its request stats (a RunningStats),
        busy time, its leader's `Engine.last_run` (steps, step timing: for metrics.json's totals) and a
        bench job's `bench_work`."""
        self.store.set(self._key(f"done/{replica}"), pickle.dumps({"rows": rows,
                                                                  "stats": vars(stats) if stats is not None else {},
                                                                  "busy_s": busy_s, "engine": engine or {},
                                                                  "bench": bench}))

    def done(self, replica: int) -> dict | None:
        key = self._key(f"done/{replica}")
        return pickle.loads(self.store.get(key)) if self.store.check([key]) else None

    def finish(self) -> None:
        self.store.set(self._key("finished"), "1")

    def is_finished(self) -> bool:
        return self.store.check([self._key("finished")])

    def forget(self, replicas: int) -> None:
        """Delete what is left of a finished hand-out (once no rank reads it: every rank saw `finished`),
        so a loop of many `LLM.generate` calls does not grow the store."""
        for name in ("chunks", "ready", "next_chunk", "finished", *(f"done/{r}" for r in range(replicas))):
            self.store.delete_key(self._key(name))


@dataclass
class ClaimedRequests:
    """A replica leader's requests: chunks claimed from the board as the engine polls (`Engine.generate`
    polls only when its batch has room); the time spent waiting for a chunk is not busy time.

    A `PolledRequests`: a claimed chunk rank 0 has not published yet is "not yet" while the replica
    runs sequences (it keeps stepping them; the claim stays this replica's and is looked at again, at
    most every POLL_S, on later polls), and is waited for only when it has nothing running."""

    board: ChunkBoard
    replicas: int
    alive: Callable[[], None] = lambda: None
    waited_s: float = 0.0
    claimed: int = 0  # requests this replica took
    pending_polls: int = 0  # polls answered NOT_YET (a claimed chunk not yet published)
    _queue: deque[PromptRequest] = field(default_factory=deque)  # the current chunk's requests not yet taken
    _claim: int | None = None  # a claimed chunk index not taken yet
    _arrived: bool = False
    _ended: bool = False
    _looked_at: float = float("-inf")  # when a non-waiting poll last read the store

    def poll(self, wait: bool) -> PromptRequest | None | NotYet:
        if self._queue:
            return self._queue.popleft()
        if self._ended:
            return None
        if not wait and time.perf_counter() - self._looked_at < POLL_S:
            self.pending_polls += 1
            return NOT_YET  # looked a moment ago: don't add a store round trip to every step
        if not self._arrived:
            t0 = time.perf_counter()
            self.board.arrive_and_wait(self.replicas, self.alive)
            self._arrived = True
            self.waited_s += time.perf_counter() - t0
        while not self._queue:
            if self._claim is None:
                self._claim = self.board.claim_index()
            if wait:
                t0 = time.perf_counter()
                chunk = self.board.wait_for(self._claim, self.alive)
                self.waited_s += time.perf_counter() - t0
            else:
                chunk = self.board.take(self._claim)
                self._looked_at = time.perf_counter()
                if chunk is NOT_YET:
                    self.alive()  # e.g. rank 0's dispatcher failed: say so now, not at the next wait
                    self.pending_polls += 1
                    return NOT_YET
            self._claim = None
            if chunk is None:
                self._ended = True
                return None
            self.claimed += len(chunk)
            self._queue.extend(chunk)
        return self._queue.popleft()

    def __iter__(self) -> Iterator[PromptRequest]:
        """Every request this replica claims, waiting for each chunk (a consumer without a batch)."""
        while (request := self.poll(wait=True)) is not None:
            yield request


@dataclass
class OutputPoster:
    """A replica leader other than rank 0: each finished request goes to rank 0 through the board, as
    `form` makes it (the job: its outputs.jsonl row; `LLM.generate`: the RequestOutput itself)."""

    board: ChunkBoard
    replica: int
    form: Callable[[RequestOutput], object] = RequestOutput.to_json
    posted: int = 0

    def __call__(self, out: RequestOutput) -> None:
        self.board.post_row(self.replica, self.posted, self.form(out))
        self.posted += 1


class Dispatcher(threading.Thread):
    """Rank 0's thread: keeps chunks published a few ahead of the claims and writes the rows the other
    replicas post (`write_row`), until `stop`. An exception is kept in `error` for the main thread."""

    def __init__(self, board: ChunkBoard, chunks: Iterator[list[PromptRequest]], num_replicas: int,
                 write_row: Callable[[Any], None]) -> None:
        super().__init__(name="dp-dispatcher", daemon=True)
        self.board, self.chunks, self.num_replicas, self.write_row = board, chunks, num_replicas, write_row
        self.published = 0
        self.exhausted = False
        self.taken = [0] * num_replicas  # rows written per replica
        self.reports: dict[int, dict] = {}  # replica -> its done/<r> record
        self.error: BaseException | None = None
        self._halt = threading.Event()
        self._lock = threading.Lock()  # one round at a time (the thread's, or `drain`'s)

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                if not self.round():
                    time.sleep(DISPATCH_POLL_S)  # nothing to publish or write: poll again soon
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread (`check`)
            self.error = exc

    def round(self) -> bool:
        """Publish up to the lookahead, write the posted rows; whether there was anything to do."""
        with self._lock:
            ahead = LOOKAHEAD_PER_REPLICA * self.num_replicas
            worked = False
            while not self.exhausted and self.published < self.board.claimed() + ahead:
                worked = True
                chunk = next(self.chunks, None)
                if chunk is None:
                    self.board.close(self.published)
                    self.exhausted = True
                else:
                    self.board.publish(self.published, chunk)
                    self.published += 1
            return self._collect() or worked

    def _collect(self) -> bool:
        written = sum(self.taken)
        for replica in range(1, self.num_replicas):
            if replica not in self.reports:
                report = self.board.done(replica)  # read before the rows: every row it counts is posted
                if report is not None:
                    self.reports[replica] = report
            while (row := self.board.take_row(replica, self.taken[replica])) is not None:
                self.write_row(row)
                self.taken[replica] += 1
        return sum(self.taken) > written

    def check(self) -> None:
        """Raise the thread's failure in the caller (a replica waiting for chunks, or the final wait)."""
        if self.error is not None:
            raise RuntimeError(f"the request dispatcher failed: {self.error!r}") from self.error

    def all_done(self) -> bool:
        """Every other replica reported its end and every row it posted is written."""
        return all(r in self.reports and self.taken[r] >= self.reports[r]["rows"] for r in range(1, self.num_replicas))

    def drain(self) -> None:
        """Write the rows already posted (the process is being stopped: finished rows are never lost)."""
        if self._lock.acquire(timeout=2.0):
            try:
                self._collect()
            except Exception:  # noqa: BLE001 - the store may be gone with the job; what was written stays
                pass
            finally:
                self._lock.release()

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=5.0)


def wait_until(done: Callable[[], bool], progress: StepProgress, check: Callable[[], None] = lambda: None) -> None:
    """Wait for the other replicas, watched like a plan wait: a dead or hung peer still ends the job
    (a gloo collective here would time out while a slower replica still works)."""
    progress.wait_plan(first=False)
    while not done():
        check()
        time.sleep(DISPATCH_POLL_S)
    progress.idle()
