"""A save that cannot be written (a full or read-only disk): one line, nothing lost, one decision.

Any rank's write can fail alone (its RNG file, rank 0's `trainer_state.json` or marker), so every
phase of a save ends with a vote over a gloo group: one all-reduce of a flag, and on failure one
gather of the reasons, so that every rank names the same failing rank, path and cause and takes
the same way on. The half-written step folder is removed (it never had its `COMPLETE` marker, so
it could not be loaded anyway) and the earlier checkpoints are left alone: pruning only ever
follows a complete save. `checkpoint.on_save_error` decides the rest: `stop` (the default) raises
`CheckpointSaveError` on every rank, naming the last complete checkpoint; `continue` logs the
line and training goes on, the next scheduled save trying again.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

# What a failed write raises: the OS's own error, DCP's collective report of it, or the
# RuntimeError of torch.save's zip writer, which reports a short write on a full disk as
# "unexpected pos N vs M" instead of the OS error.
SAVE_ERRORS: tuple[type[BaseException], ...] = (OSError, CheckpointException, RuntimeError)
_SHORT_WRITE = "unexpected pos"


class CheckpointSaveError(RuntimeError):
    """A save failed under `checkpoint.on_save_error: stop`; raised on every rank at the same save."""


def _root_cause(error: BaseException) -> BaseException:
    """The OS error behind DCP's `CheckpointException` (it maps each failing rank to its error)."""
    if isinstance(error, CheckpointException):
        for failure in error.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                return _root_cause(inner)
    cause = error.__cause__
    if not isinstance(error, OSError) and isinstance(cause, BaseException):
        return _root_cause(cause)
    return error


def reason(error: BaseException) -> str:
    """A short cause: `No space left on device` (with the file when the OS names one)."""
    cause = _root_cause(error)
    if isinstance(cause, OSError):
        text = (
            cause.strerror or (errno.errorcode.get(cause.errno or 0, "") if cause.errno else "") or str(cause)
        )
        return f"{text} ({cause.filename})" if cause.filename else text
    text = str(cause).strip()
    if _SHORT_WRITE in text:
        where = text[text.index(_SHORT_WRITE) :].split("\n", 1)[0]
        return f"a file stopped short (torch.save's writer: {where}): no space left on the device?"
    return f"{type(cause).__name__}: {text}"


def free_space(path: Path) -> str:
    """The free space of the filesystem holding `path` (or its nearest existing parent)."""
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return "free space unknown"
    return f"{free / 2**20:,.1f} MiB free"


class SaveGuard:
    """The vote that ends each phase of a save, and what follows a failed one.

    Args:
        group: a gloo group of every rank (None in a single process).
        rank: this rank, whose half-written folder rank 0 removes.
        on_error: `checkpoint.on_save_error` (`stop` or `continue`).
        log: the run's log.
    """

    def __init__(
        self, group: dist.ProcessGroup | None, *, rank: int, on_error: str, log: Callable[[str], None]
    ) -> None:
        # One flag all-reduce after each of a save's four phases: microseconds on gloo.
        self.group = group
        self.rank = rank
        self.on_error = on_error
        self.log = log
        self.failures = 0

    def settle(self, error: BaseException | None, *, target: Path, step: int, last: Path | None) -> bool:
        """Collective: True when the phase succeeded on every rank; otherwise the failed save's
        folder is removed and the line logged (`continue`, returns False) or raised (`stop`)."""
        failed = error is not None
        several = self.group is not None and dist.get_world_size(self.group) > 1
        if several:
            flag = torch.tensor([int(failed)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            if not int(flag.item()):
                return True
            reports: list[object] = [None] * dist.get_world_size(self.group)
            # The failing rank's own reading of the free space: every rank logs the same line, and
            # a node-local disk is measured where the write failed.
            mine = None if error is None else (self.rank, reason(error), free_space(target))
            dist.all_gather_object(reports, mine, group=self.group)
            found = next(report for report in reports if isinstance(report, tuple))
            failing_rank, cause, free = found
        elif error is None:
            return True
        else:
            failing_rank, cause, free = self.rank, reason(error), free_space(target)
        self.failures += 1
        if self.rank == 0:
            shutil.rmtree(target, ignore_errors=True)
        where = f" on rank {failing_rank}" if several else ""
        kept = (
            f"the last complete checkpoint is {last}"
            if last is not None
            else "no complete checkpoint was saved yet"
        )
        line = f"checkpoint: saving step {step} to {target} failed{where}: {cause} ({free} there); {kept}"
        if self.on_error == "stop":
            raise CheckpointSaveError(f"{line}; stopping (checkpoint.on_save_error: stop)")
        self.log(f"{line}; training goes on (checkpoint.on_save_error: continue)")
        return False
