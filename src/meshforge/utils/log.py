"""Rank-aware logging: rank 0 speaks, other ranks only report warnings and errors."""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

_CONFIGURED = False


class _CurrentStdStream(logging.StreamHandler[TextIO]):
    """Writes to whatever `sys.stdout` (or `sys.stderr`) is when a record is emitted.

    A handler that kept the stream of the moment it was made would keep writing to the terminal
    after a caller redirected the output (`contextlib.redirect_stdout`, a notebook's capture,
    a command run in-process by a test).
    """

    def __init__(self, *, to_stdout: bool) -> None:
        super().__init__()
        self._to_stdout = to_stdout

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout if self._to_stdout else sys.stderr
        super().emit(record)


def get_logger(name: str = "meshforge") -> logging.Logger:
    """The meshforge logger, configured once for this process's rank."""
    global _CONFIGURED
    logger = logging.getLogger(name if name.startswith("meshforge") else f"meshforge.{name}")
    if not _CONFIGURED:
        root = logging.getLogger("meshforge")
        rank = int(os.environ.get("RANK", 0))
        handler = _CurrentStdStream(to_stdout=rank == 0)
        prefix = "" if int(os.environ.get("WORLD_SIZE", 1)) == 1 else f"[rank{rank}] "
        handler.setFormatter(logging.Formatter(f"{prefix}%(message)s"))
        root.handlers[:] = [handler]
        root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        root.propagate = False
        _CONFIGURED = True
    return logger
