"""Rank-aware logging: rank 0 speaks, other ranks only report warnings and errors."""

from __future__ import annotations

import logging
import os
import sys

_CONFIGURED = False


def get_logger(name: str = "meshforge") -> logging.Logger:
    """The meshforge logger, configured once for this process's rank."""
    global _CONFIGURED
    logger = logging.getLogger(name if name.startswith("meshforge") else f"meshforge.{name}")
    if not _CONFIGURED:
        root = logging.getLogger("meshforge")
        rank = int(os.environ.get("RANK", 0))
        handler = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
        prefix = "" if int(os.environ.get("WORLD_SIZE", 1)) == 1 else f"[rank{rank}] "
        handler.setFormatter(logging.Formatter(f"{prefix}%(message)s"))
        root.handlers[:] = [handler]
        root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        root.propagate = False
        _CONFIGURED = True
    return logger
