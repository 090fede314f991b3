"""Persistent pools of spawned gloo ranks that the distributed tests share, one pool per world size.

A fresh spawn pays for an interpreter, the torch import (about 2.6 s here) and the gloo
rendezvous on every rank, for every test. A pool pays that once: its ranks join one gloo process
group when the pool starts and then run task after task, each a module-level function (pickled by
name) called as `fn(rank, world, *args)` on every rank, followed by a barrier.

A task sees the test's environment variables and working directory, as a spawned process would.
What a task may leave behind is put back before the next one (`_Baseline`): environment
variables, working directory, default dtype and device, deterministic-algorithm flags, thread
count, grad mode, warning filters, signal handlers, the RNGs (reseeded from the OS, as a fresh
process is), the process groups a task created (destroyed, the default group kept) and dynamo's
compile caches. A task that destroys the default group itself leaves the pool unusable: the pool
notices and starts afresh before the next task. State outside that list (a module attribute a
task reassigns and does not restore) is the task's to restore; a test that cannot do so asks for
`fresh=True` in `tests.distributed._spawn.run_workers`.

A failing task never leaves its pool behind: when a rank raises, crashes or outlives the timeout,
the others may be stuck in a collective, so the whole pool is killed and the next task starts a
new one. The failure message holds every failing rank's traceback.
"""

from __future__ import annotations

import atexit
import multiprocessing.connection
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.context import SpawnProcess
from typing import Any

import torch.multiprocessing as mp

from tests.distributed._exit import leave_worker

# How long the other ranks get to report once one rank failed (they may be inside a collective
# that will never complete; their tracebacks help when they do arrive).
_GRACE_S = 5.0
# Starting is an interpreter, the torch import and the rendezvous per rank: seconds on a quiet
# machine, minutes on a loaded one (a spawn before the pool had no limit of its own either).
_START_TIMEOUT_S = 600.0
# The process groups tasks created stay alive (see the module docstring); past this many (each
# holds gloo threads and sockets) the pool starts afresh.
_MAX_GROUPS = 64
_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP")
    if hasattr(signal, name)
)


class _Baseline:
    """The per-process state a task may change, captured once the rank joined its group."""

    def __init__(self) -> None:
        import torch

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.dtype = torch.get_default_dtype()
        self.device = torch.get_default_device()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        self.threads = torch.get_num_threads()
        self.filters = list(warnings.filters)
        self.handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS}
        self.modules = set(sys.modules)

    def before_task(self, environ: dict[str, str], cwd: str) -> None:
        """What a freshly spawned rank would start from: the test's environment and folder, and
        the RNGs of a new process (torch's and Python's seeded from the OS)."""
        import torch

        os.environ.clear()
        os.environ.update(environ)
        os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        os.chdir(cwd)
        torch.seed()
        random.seed()

    def after_task(self) -> str | None:
        """Put everything back; the reason the pool must restart instead, or None."""
        import torch
        import torch.distributed as dist

        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        torch.set_default_dtype(self.dtype)
        if torch.get_default_device() != self.device:
            # None for a CPU baseline: setting "cpu" would install a device mode on every call.
            torch.set_default_device(None if self.device.type == "cpu" else self.device)
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.warn_only)
        torch.set_num_threads(self.threads)
        torch.set_grad_enabled(True)
        warnings.filters[:] = self.filters
        warnings._filters_mutated()  # type: ignore[attr-defined]
        for sig, handler in self.handlers.items():
            if signal.getsignal(sig) is not handler and handler is not None:
                signal.signal(sig, handler)
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        if not dist.is_initialized():
            return "the task destroyed the default process group"
        if _group_count() > _MAX_GROUPS:
            return f"the tasks left more than {_MAX_GROUPS} process groups"
        return None


def _group_count() -> int:
    from torch.distributed.distributed_c10d import _world

    return len(_world.pg_map)


def _serve(rank: int, world: int, init_file: str, conn: multiprocessing.connection.Connection) -> None:
    """One rank of a pool: join the group, then run tasks until told to stop (None)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    baseline = _Baseline()
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
            if task is None:
                break
            fn, args, environ, cwd = task
            baseline.before_task(environ, cwd)
            result = fn(rank, world, *args)
            if dist.is_initialized():
                dist.barrier()
            restart = baseline.after_task()
            conn.send(("ok", (result, restart)))
        except EOFError:
            break  # the test process is gone
        except BaseException:
            # Also a task that cannot be unpickled here, or a result that cannot be sent back.
            conn.send(("error", f"rank {rank}:\n{traceback.format_exc()}"))
            break  # the parent kills the pool: the other ranks may be inside a collective
    leave_worker()


class WorkerPool:
    """`world` spawned ranks in one gloo group, running tasks one after another."""

    def __init__(self, world: int) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.world = world
        self.tasks = 0
        self._tmp = tempfile.mkdtemp(prefix=f"meshforge-pool{world}-")
        ctx = mp.get_context("spawn")
        self._procs: list[SpawnProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        init = os.path.join(self._tmp, "init")
        for rank in range(world):
            parent, child = ctx.Pipe()
            # Not daemonic: a task may start processes of its own (data-loader workers).
            proc = ctx.Process(target=_serve, args=(rank, world, init, child), daemon=False)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        replies = self._collect(_START_TIMEOUT_S)
        failed = [f"rank {rank}: {msg}" for rank, (kind, msg) in replies.items() if kind != "ready"]
        failed += [
            f"rank {r}: not ready after {_START_TIMEOUT_S:.0f} s" for r in range(world) if r not in replies
        ]
        if failed:
            self.close()
            raise AssertionError(f"the {world}-rank test pool did not start:\n" + "\n".join(failed))

    def run(self, fn: Callable[..., Any], args: tuple[object, ...], timeout: float) -> list[Any]:
        """`fn(rank, world, *args)` on every rank; each rank's return value, in rank order.

        Raises:
            AssertionError: With every failing rank's traceback, or the ranks that crashed or
                outlived `timeout` seconds. The pool is closed then (`alive` is False).
        """
        self.tasks += 1
        task = (fn, args, dict(os.environ), os.getcwd())
        for conn in self._conns:
            conn.send(task)
        replies = self._collect(timeout)
        messages = [msg for kind, msg in replies.values() if kind == "error"]
        for rank, proc in enumerate(self._procs):
            if rank in replies:
                continue
            if proc.exitcode is not None:
                messages.append(f"rank {rank}: exit code {proc.exitcode} (crashed)")
            else:
                messages.append(
                    f"rank {rank}: no result after {timeout} s, or stuck once another rank failed"
                )
        if messages:
            self.close()
            raise AssertionError("\n".join(messages))
        results = [replies[rank][1] for rank in range(self.world)]
        if any(restart for _, restart in results):
            self.close()  # the next task gets a new pool
        return [result for result, _ in results]

    def _collect(self, timeout: float) -> dict[int, tuple[str, Any]]:
        """One reply per rank until all replied, one failed (then `_GRACE_S` more) or `timeout`."""
        replies: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        by_conn = {id(conn): rank for rank, conn in enumerate(self._conns)}
        by_sentinel = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while len(replies) < self.world:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            waiting = [conn for rank, conn in enumerate(self._conns) if rank not in replies]
            sentinels = [proc.sentinel for rank, proc in enumerate(self._procs) if rank not in replies]
            ready = multiprocessing.connection.wait([*waiting, *sentinels], timeout=left)
            for item in ready:
                if isinstance(item, int):
                    # A rank's process ended: take what it sent before, else it crashed.
                    rank = by_sentinel[item]
                    conn = self._conns[rank]
                    if rank not in replies and conn.poll():
                        replies[rank] = _receive(conn)
                    elif rank not in replies:
                        replies[rank] = (
                            "error",
                            f"rank {rank}: exit code {self._procs[rank].exitcode} (crashed)",
                        )
                else:
                    rank = by_conn[id(item)]
                    if rank not in replies:
                        replies[rank] = _receive(item)
            if any(kind == "error" for kind, _ in replies.values()):
                deadline = min(deadline, time.monotonic() + _GRACE_S)
        return replies

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(proc.is_alive() for proc in self._procs)

    def close(self) -> None:
        """Stop the ranks (those busy or stuck are killed) and remove the rendezvous folder."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 2
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        shutil.rmtree(self._tmp, ignore_errors=True)


def _receive(conn: multiprocessing.connection.Connection) -> tuple[str, Any]:
    try:
        return conn.recv()
    except (EOFError, OSError) as error:
        return ("error", f"the rank's result could not be read: {error!r}")


_POOLS: dict[int, WorkerPool] = {}


def pool(world: int) -> WorkerPool:
    """The live pool of `world` ranks, started on first use or after a failed task."""
    current = _POOLS.get(world)
    if current is None or not current.alive:
        if current is not None:
            current.close()
        current = _POOLS[world] = WorkerPool(world)
    return current


def close_pools() -> None:
    """Stop every pool (at the end of the session; also registered with atexit)."""
    while _POOLS:
        _, current = _POOLS.popitem()
        current.close()


atexit.register(close_pools)
