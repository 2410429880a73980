"""The job's one error line: once on stderr, and in the job's log file (not again on stdout).

Why: a failed job must say why exactly once on the terminal, yet the log file in the output
directory should keep the reason too.
"""
from __future__ import annotations

import logging
import sys

log = logging.getLogger("spmd_engine")


def report_error(message: str, fresh_line: bool = False) -> None:
    """`fresh_line`: start with a newline (a progress bar may own the current terminal line)."""
    line = "error: " + " ".join(str(message).split())
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    print(("\n" if fresh_line else "") + line, file=sys.stderr, flush=True)
