"""Per-request results and the crash-safe outputs.jsonl writer.

Lines are appended and flushed to the OS the moment a request finishes (so a crash, SIGKILL or
SIGTERM of the process loses no finished completion) and fsynced a moment later by a background
thread (durable against a machine crash without the step loop waiting for the disk); at a clean end
the file is rewritten in submission order. A resumed job
first rewrites the complete lines it keeps, so a line torn by the crash can't swallow the next.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from spmd_engine.core.requests import (  # noqa: F401
    ERROR_ECHO_CHARS,
    ERROR_ECHO_TOKENS,
    ERROR_TEXT_CHARS,
    OPTIONAL_FIELDS,
    RequestOutput,
    error_echo,
)

# line breaks to str.splitlines (not to JSON): escaped, so a row stays one line to any reader
_SPLITLINES_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def _dumps(row: dict) -> str:
    """One JSON line; text that can't be UTF-8 (a lone surrogate) is written escaped instead of failing."""
    line = json.dumps(row, ensure_ascii=False)
    if line.isascii():  # the common case (token ids, ASCII text): nothing to check or escape
        return line + "\n"
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(row)
    return line.translate(_SPLITLINES_BREAKS) + "\n"


class OutputsWriter:
    """Appends finished requests to outputs.jsonl as they finish; `finalize` sorts the file."""

    def __init__(self, path: Path, keep: list[dict] | None = None,
                 sampling_of: Callable[[int], dict | None] | None = None,
                 final_form: Callable[[list[dict]], dict] | None = None) -> None:
        """`sampling_of(index)`: the request's sampling parameters, written as the row's `sampling`
        (what a resumed job checks its kept rows against). `final_form(rows)`: what `finalize` writes
        for each request (its rows, one per completion) instead of its rows (output_format=openai);
        lines appended during the run stay rows."""
        self.path = Path(path)
        self.sampling_of = sampling_of
        self.final_form = final_form
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep:
            _rewrite(self.path, keep)
        self._file = open(self.path, "a" if keep else "w", encoding="utf-8")
        self._lock = threading.Lock()
        self._sync = _BackgroundSync(self._file.fileno())

    def write(self, out: RequestOutput) -> None:
        self.write_row(out.to_json())

    def write_row(self, row: dict) -> None:
        """Append one finished request's row (`RequestOutput.to_json`, e.g. one another replica sent)."""
        if self.sampling_of is not None:
            row["sampling"] = self.sampling_of(row["index"])
        line = _dumps(row)
        with self._lock:
            self._file.write(line)
            self._file.flush()
        self._sync.request()

    def quiesce(self, timeout_s: float = 5.0) -> None:
        """Before the process is ended from another thread: let a line being written finish, block the
        rest, and make what is written durable."""
        if self._lock.acquire(timeout=timeout_s) and not self._file.closed:
            try:
                os.fsync(self._file.fileno())
            except OSError:
                pass

    def finalize(self) -> None:
        """Rewrite the file in submission order (index, then sample_index), one line per completion (the
        first kept), atomically.

        Holds (key, offset, length) per row, not the rows: a job of any size sorts in bounded memory."""
        self.close()
        first: dict[tuple[int, int], tuple[int, int]] = {}
        with open(self.path, "rb") as f:
            offset = 0
            for line in f:
                row = _parse_row(line)
                if row is not None and row_key(row) not in first:
                    first[row_key(row)] = (offset, len(line))
                offset += len(line)
            rows = (_parse_row(_read_at(f, *first[key])) for key in sorted(first))
            _rewrite(self.path, rows if self.final_form is None else map(self.final_form, _by_request(rows)))

    def close(self) -> None:
        """Stop the background fsync, fsync what is written and close the file."""
        if not self._file.closed:
            self._sync.stop()
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()


class _BackgroundSync:
    """fsyncs a file descriptor on its own thread whenever asked: a finished row costs the step loop a
    flush, not a wait for the disk (~0.6 ms per fsync on the CI disk, once per finished request)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._wanted = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="outputs-fsync", daemon=True)
        self._thread.start()

    def request(self) -> None:
        self._wanted.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wanted.wait()
            self._wanted.clear()
            if self._stopping:
                return
            try:
                os.fsync(self._fd)
            except OSError:  # the disk failed: the next write or the final close reports it
                pass

    def stop(self) -> None:
        """Let a running fsync finish and end the thread (the owner fsyncs and closes after this)."""
        self._stopping = True
        self._wanted.set()
        self._thread.join()


def _by_request(rows: Iterable[dict]) -> Iterator[list[dict]]:
    """Consecutive rows of one request (its completions) as one list."""
    group: list[dict] = []
    for row in rows:
        if group and group[0]["index"] != row["index"]:
            yield group
            group = []
        group.append(row)
    if group:
        yield group


def row_key(row: dict) -> tuple[int, int]:
    """A row's place: its request's index, then its completion (`sample_index`, written when n > 1)."""
    sample = row.get("sample_index")
    return row["index"], sample if isinstance(sample, int) and not isinstance(sample, bool) else 0


def _read_at(f, offset: int, length: int) -> bytes:
    f.seek(offset)
    return f.read(length)


def _parse_row(line: bytes) -> dict | None:
    """A complete outputs.jsonl row, or None (a torn line from a crash, a line that is not a row)."""
    try:
        row = json.loads(line.decode("utf-8", errors="replace"))  # a torn multi-byte character is no error
    except json.JSONDecodeError:
        return None
    if isinstance(row, dict) and isinstance(row.get("index"), int) and not isinstance(row["index"], bool):
        return row
    return None


def _rewrite(path: Path, rows: Iterable[dict]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(_dumps(r))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_outputs(path: Path) -> list[dict]:
    """Complete lines of an outputs.jsonl (a torn last line from a crash is ignored)."""
    if not Path(path).exists():
        return []
    with open(path, "rb") as f:
        return [row for row in map(_parse_row, f) if row is not None]


def _same_echo(kept: Any, full_len: Any, now: Any) -> bool:
    """Whether a row's (possibly capped) echo `kept` of full length `full_len` is the value `now`."""
    if kept is None or now is None:
        return kept is None and now is None
    return len(now) == full_len and now[:len(kept)] == kept


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# sampling keys added after rows were first written: a kept row without one had its default
_LATER_SAMPLING_KEYS = {"stop": None, "stop_token_ids": None, "min_tokens": 0, "include_stop_str_in_output": False,
                        "logprobs": None, "prompt_logprobs": None, "min_p": 0.0, "repetition_penalty": 1.0,
                        "presence_penalty": 0.0, "frequency_penalty": 0.0}


def _row_differs(row: dict, prompt: str | None, prompt_token_ids: list[int] | None,
                 sampling: dict | None) -> str | None:
    kept_prompt = row.get("prompt")
    if not _same_echo(kept_prompt, row.get("prompt_chars", len(kept_prompt or "")), prompt):
        return f"prompt differs: kept {_short_repr(kept_prompt)}, now {_short_repr(prompt)}"
    kept_ids = row.get("prompt_token_ids")
    ids_known = prompt is None or (kept_ids is not None and prompt_token_ids is not None)
    if ids_known and not _same_echo(kept_ids, row.get("prompt_num_tokens", len(kept_ids or [])),
                                    prompt_token_ids):
        return f"prompt_token_ids differ: kept {_short_repr(kept_ids)}, now {_short_repr(prompt_token_ids)}"
    kept_sampling = row.get("sampling")
    if isinstance(kept_sampling, dict) and sampling is not None:
        for key in sorted(set(kept_sampling) | set(sampling)):
            kept, now = kept_sampling.get(key, _LATER_SAMPLING_KEYS.get(key)), sampling.get(key)
            if kept != now and not (kept != kept and now != now):  # NaN (an error row's) is NaN again
                return f"sampling.{key} differs: kept {kept!r}, now {now!r}"
    return None


def resume_mismatch(rows: list[dict], requests: Iterable, sampling_of: Callable[[int], dict | None],
                    total: int | None = None) -> str | None:
    """Why the kept `rows` are not outputs of this job's `requests` (one line naming the first row that
    differs in prompt, token ids or sampling), or None when every kept row matches its request.

    `requests` come in index order and may be an iterator (only those with a kept row are needed);
    `total`: the job's request count, for the message (default: how many `requests` gave).
    Why: a resumed job skips the indices it finds; rows of another prompts file or other sampling
    would silently stand in for requests that never ran.
    """
    first_rows: dict[int, dict] = {}
    for row in rows:
        first_rows.setdefault(row["index"], row)  # finalize keeps the first line of an index
    seen = 0
    for request in requests:
        seen += 1
        row = first_rows.pop(request.index, None)
        if row is None:
            continue
        index = request.index
        try:
            why = _row_differs(row, request.prompt, request.prompt_token_ids, sampling_of(index))
        except (TypeError, ValueError):  # a row edited by hand: fields of other types
            why = "its prompt fields are not ones this engine writes"
        if why:
            return f"outputs.jsonl row {index} is not this job's request {index}: {why}"
    if first_rows:
        return (f"outputs.jsonl row {min(first_rows)} has no request in this job "
                f"({seen if total is None else total} requests)")
    return None
