"""Start spawned gloo workers and fail the test with every rank's traceback.

A worker is a module-level function `worker(rank, world, init_file, *extra, errors)` that puts
`"rank r: <traceback>"` on `errors` when it fails (and leaves through `_exit.leave_worker`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_workers(worker: Callable[..., None], world: int, *extra: Any, timeout: float = 120) -> None:
    """Run `worker` on `world` spawned processes sharing a file rendezvous; assert they all passed."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=worker, args=(r, world, init, *extra, errors)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        messages = []
        while not errors.empty():
            messages.append(errors.get())
        for p in procs:
            if p.is_alive():
                p.kill()
                messages.append(f"pid {p.pid} timed out after {timeout} s")
        assert not messages and all(p.exitcode == 0 for p in procs), "\n".join(messages)


def start_workers(worker: Callable[..., None], nprocs: int, *extra: Any) -> None:
    """Run `worker(rank, *extra, errors)` on `nprocs` processes (torch's `start_processes`); assert none failed."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    errors = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(*extra, errors), nprocs=nprocs, join=True, start_method="spawn")
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, "\n".join(failures)
