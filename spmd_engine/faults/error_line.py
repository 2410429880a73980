"""The job's one error line: once on stderr, in the job's log file (not again on stdout), and under
torchrun in the rank's torchelastic error file.

Why: a failed job must say why exactly once on the terminal, yet the log file in the output
directory should keep the reason too; and torchrun ends a failed launch with its own summary
(after everything the ranks printed), whose "Root Cause" entry shows the error file's message, so
the line is written there too: the summary's last entry is then the reason, not a link to docs.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time

log = logging.getLogger("spmd_engine")
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # set by torchrun for each rank it starts


def error_line(message: str) -> str:
    """`message` as the job's one error line."""
    return "error: " + " ".join(str(message).split())


def report_error(message: str, fresh_line: bool = False) -> None:
    """`fresh_line`: start with a newline (a progress bar may own the current terminal line)."""
    line = error_line(message)
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    print(("\n" if fresh_line else "") + line, file=sys.stderr, flush=True)
    write_error_file(line)


def write_error_file(line: str) -> None:
    """Under torchrun: the rank's error file in torchelastic's format, `line` as message and traceback.

    torchrun reads it when this rank exits non-zero and prints it as the root cause's `traceback`,
    the last entry of its summary (a rank that exits 0, e.g. a multirun going on, is not reported).
    """
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # the terminal line is already out; the file only adds to torchrun's summary
        pass
