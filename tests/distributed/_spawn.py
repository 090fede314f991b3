"""Start spawned gloo workers and fail the test with the failing ranks' tracebacks.

A worker is a module-level function `worker(rank, world, *extra)`. It runs inside a gloo process
group that `run_workers` has already joined (file rendezvous, one thread per process), and it
just raises to fail: the failing rank's traceback is sent back and becomes the test's failure
message, and the other ranks, which may wait forever in a collective, are stopped 5 s later.
After the worker returns, all ranks meet at a barrier and leave through `_exit.leave_worker`.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.queues import SimpleQueue
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed._exit import leave_worker


def _entry(
    rank: int,
    world: int,
    init_file: str,
    worker: Callable[..., None],
    extra: tuple[object, ...],
    errors: SimpleQueue,
) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        worker(rank, world, *extra)
        dist.barrier()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    leave_worker()


def run_workers(worker: Callable[..., None], world: int, *extra: object, timeout: float = 300) -> None:
    """Run `worker(rank, world, *extra)` on `world` spawned processes; assert every rank passed.

    A rank that raises, exits non-zero or outlives `timeout` seconds fails the test, with the
    tracebacks of the ranks that raised.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_entry, args=(r, world, init, worker, extra, errors), daemon=False)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            if any(p.exitcode not in (0, None) for p in procs):
                # One rank failed: the others may wait forever in a collective; give them a moment.
                deadline = min(deadline, time.monotonic() + 5)
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        messages = []
        while not errors.empty():
            messages.append(errors.get())
        for rank, p in enumerate(procs):
            if p.exitcode != 0 and not any(m.startswith(f"rank {rank}:") for m in messages):
                messages.append(
                    f"rank {rank}: exit code {p.exitcode} (crashed, or killed after {timeout} s or once another rank failed)"
                )
        assert not messages, "\n".join(messages)


def train_runs(rank: int, world: int, runs: list[tuple[str, list[str]]]) -> None:
    """A worker: each `(config, overrides)` trained in turn as a whole run on these ranks."""
    from tests.conftest import train_here

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    for config, overrides in runs:
        train_here(Path(config), overrides)
