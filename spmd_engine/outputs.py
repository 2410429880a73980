"""Per-request results and the crash-safe outputs.jsonl writer.

Lines are appended and fsynced the moment a request finishes (so a crash or SIGTERM loses no
finished completion); at a clean end the file is rewritten in submission order. A resumed job
first rewrites the complete lines it keeps, so a line torn by the crash can't swallow the next.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class RequestOutput:
    index: int
    prompt: str | None
    prompt_token_ids: list[int] | None
    text: str | None
    token_ids: list[int]
    finish_reason: str  # stop | length | error
    error: str | None = None
    # timing (seconds, relative to the generate call's start); not written to outputs.jsonl
    first_token_time: float | None = field(default=None, repr=False)
    finish_time: float | None = field(default=None, repr=False)
    token_times: list[float] = field(default_factory=list, repr=False)
    num_cached_tokens: int = field(default=0, repr=False)

    def to_json(self) -> dict:
        d = asdict(self)
        for k in ("first_token_time", "finish_time", "token_times", "num_cached_tokens"):
            d.pop(k)
        return d


class OutputsWriter:
    """Appends finished requests to outputs.jsonl as they finish; `finalize` sorts the file."""

    def __init__(self, path: Path, keep: list[dict] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep:
            _rewrite(self.path, keep)
        self._file = open(self.path, "a" if keep else "w", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, out: RequestOutput) -> None:
        line = json.dumps(out.to_json(), ensure_ascii=False) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())

    def quiesce(self, timeout_s: float = 5.0) -> None:
        """Before the process is ended from another thread: let a line being written finish, block the rest."""
        self._lock.acquire(timeout=timeout_s)

    def finalize(self) -> None:
        """Rewrite the file in submission (index) order, one line per index (the first kept), atomically."""
        self._file.close()
        rows = {}
        for row in read_outputs(self.path):
            rows.setdefault(row["index"], row)
        _rewrite(self.path, [rows[i] for i in sorted(rows)])

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def _rewrite(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_outputs(path: Path) -> list[dict]:
    """Complete lines of an outputs.jsonl (a torn last line from a crash is ignored)."""
    rows = []
    if not Path(path).exists():
        return rows
    with open(path, encoding="utf-8", errors="replace") as f:  # a torn multi-byte character is no error
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("index"), int) and not isinstance(row["index"], bool):
                rows.append(row)
    return rows
