"""Run a function on spawned gloo ranks and fail the test with the failing ranks' tracebacks.

A worker is a module-level function `worker(rank, world, *extra)`. It runs inside a gloo process
group that the ranks have already joined (file rendezvous, one thread per process), and it just
raises to fail: the failing rank's traceback is sent back and becomes the test's failure message,
and the other ranks, which may wait forever in a collective, are stopped 5 s later. After the
worker returns, all ranks meet at a barrier.

The ranks are those of a persistent pool per world size (`tests.distributed._pool`): torch is
imported and the group joined once per session, not once per test, and what a task changes in
its processes is put back before the next. `fresh=True` runs one task in ranks of its own, for a
test whose state the pool cannot put back.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.distributed._pool import WorkerPool, pool


def run_workers(
    worker: Callable[..., Any], world: int, *extra: object, timeout: float = 300, fresh: bool = False
) -> list[Any]:
    """Run `worker(rank, world, *extra)` on `world` ranks; assert every rank passed.

    Returns each rank's return value (picklable), in rank order. A rank that raises, crashes or
    outlives `timeout` seconds fails the test, with the tracebacks of the ranks that raised; the
    pool is then replaced, so a hung or failed task cannot spoil the next test.
    """
    if fresh:
        own = WorkerPool(world)
        try:
            return own.run(worker, extra, timeout)
        finally:
            own.close()
    return pool(world).run(worker, extra, timeout)


def train_runs(rank: int, world: int, runs: list[tuple[str, list[str]]]) -> None:
    """A worker: each `(config, overrides)` trained in turn as a whole run on these ranks."""
    from tests.conftest import train_here

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    for config, overrides in runs:
        train_here(Path(config), overrides)
