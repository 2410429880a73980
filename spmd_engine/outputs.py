"""Per-request results and the crash-safe outputs.jsonl writer.

Lines are appended and flushed the moment a request finishes (so a crash or SIGTERM loses no
finished completion); at a clean end the file is rewritten in submission order.
"""
from __future__ import annotations

import json
import os
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
        self._file = open(self.path, "a" if keep else "w", encoding="utf-8")

    def write(self, out: RequestOutput) -> None:
        self._file.write(json.dumps(out.to_json(), ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def finalize(self) -> None:
        """Rewrite the file in submission (index) order, atomically."""
        self._file.close()
        rows = read_outputs(self.path)
        rows.sort(key=lambda r: r["index"])
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(tmp, self.path)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_outputs(path: Path) -> list[dict]:
    """Complete lines of an outputs.jsonl (a torn last line from a crash is ignored)."""
    rows = []
    if not Path(path).exists():
        return rows
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "index" in row:
                rows.append(row)
    return rows
