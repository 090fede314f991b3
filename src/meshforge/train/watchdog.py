"""The step watchdog: a step that never ends says where every rank is, and the job exits.

A rank stuck in a collective (a peer that died, hangs in its data loader or sleeps) would wait for
the process group's timeout and then die with torch's message, naming neither the rank that did
not arrive nor the step. Here a thread per rank is armed while a step computes; when the step
outlives `training.step_timeout_s` it writes `{output_dir}/hang-rank{R}.txt` (the collective in
flight: op, group size, shapes; the last ones issued; every thread's Python stack via
faulthandler), publishes a one-line report in the job's rendezvous store, reads the peers'
reports for a few seconds, and rank 0 prints one line naming the ranks that had not arrived (those
that issued fewer collectives in the step than the others, or sent no report at all). Every rank
then exits with `HANG_EXIT_CODE`, so that `torchrun --max-restarts` (and `checkpoint.load_path:
auto`) can take the run on from its last checkpoint.

The collectives are followed by wrapping the `torch.distributed` functions the stack calls at
run time (FSDP2's all-gathers and reduce-scatters, the loop's all-reduces, pipeline send/recv):
one Python call and a tuple per collective. Functional collectives inside compiled graphs are not
seen; the stacks still show where the rank waits.

The timeout: a number fixes it; `null` (the default) is max(10 min, 20 x the median of the last
50 step times) once 3 steps are measured (at most 25 min, so it speaks before the process
group's 30-min timeout) and 20 min before that (compilation, data preparation); 0 turns it off.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import re
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HANG_EXIT_CODE = 3
_FLOOR_S = 600.0
_CAP_S = 1500.0
_EARLY_S = 1200.0
_STEPS_MEASURED = 3
_REPORT_WAIT_S = 5.0
# The public collectives and point-to-point calls of `torch.distributed`, looked up at install.
_COLLECTIVE = re.compile(r"gather|scatter|reduce|broadcast|all_to_all|send|recv|barrier")
# Left as they are: `P2POp` checks its `op` by identity against these two (the pipeline's
# `batch_isend_irecv`, which is followed, carries them).
_IDENTITY_CHECKED = frozenset({"isend", "irecv"})


def _describe_args(args: tuple[object, ...], kwargs: dict[str, object]) -> str:
    shapes = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            shapes.append(f"{value.dtype}".removeprefix("torch.") + str(list(value.shape)))
        elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            shapes.append(f"{len(value)} tensors")
    named = kwargs.get("group")
    group = named if isinstance(named, dist.ProcessGroup) else None
    group = group or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    try:
        size = dist.get_world_size(group) if dist.is_initialized() else 1
    except (RuntimeError, ValueError):
        size = -1
    return f"over {size} ranks, {', '.join(shapes) or 'no tensors'}"


class CollectiveTracker:
    """Which collective this rank is in now, and the last ones it issued (thread-safe enough:
    one writer, the step's thread, and one reader, the watchdog)."""

    def __init__(self) -> None:
        self.in_flight: str | None = None
        self.issued = 0  # in the current step
        self.recent: deque[str] = deque(maxlen=8)
        self._originals: dict[str, Callable[..., Any]] = {}

    def install(self) -> None:
        for name in dir(dist):
            original = getattr(dist, name)
            if (
                name.startswith("_")
                or name in _IDENTITY_CHECKED
                or name[0].isupper()
                or not _COLLECTIVE.search(name)
                or not callable(original)
                or getattr(original, "_meshforge_tracked", False)
            ):
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, original))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            what = f"{name} {_describe_args(args, kwargs)}" + (" (async)" if kwargs.get("async_op") else "")
            self.issued += 1
            self.recent.append(what)
            self.in_flight = what
            try:
                return original(*args, **kwargs)
            finally:
                self.in_flight = None

        tracked._meshforge_tracked = True  # type: ignore[attr-defined]
        return tracked


class StepWatchdog:
    """Arms a deadline around each step's computation; see the module docstring.

    Args:
        timeout_s: `training.step_timeout_s` (None: derived from the step times; 0: off).
        output_dir: where the `hang-rank{R}.txt` files go.
        rank, world_size: this rank and the job's size.
        log: the run's log (rank 0 prints the one line).
        exit: how a hung rank leaves (`os._exit` with `HANG_EXIT_CODE`; tests replace it).
    """

    def __init__(
        self,
        timeout_s: float | None,
        *,
        output_dir: Path,
        rank: int,
        world_size: int,
        log: Callable[[str], None],
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.fixed = timeout_s
        self.output_dir = output_dir
        self.rank = rank
        self.world_size = world_size
        self.log = log
        self.exit = exit
        self.tracker = CollectiveTracker()
        self.step_times: deque[float] = deque(maxlen=50)
        self._step = 0
        self._deadline: float | None = None
        self._armed_at = 0.0
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.fixed is None or self.fixed > 0

    def timeout(self) -> float:
        """The current limit of one step, in seconds."""
        if self.fixed is not None:
            return self.fixed
        if len(self.step_times) < _STEPS_MEASURED:
            return _EARLY_S
        return min(_CAP_S, max(_FLOOR_S, 20 * statistics.median(self.step_times)))

    def start(self) -> None:
        if not self.enabled or self._thread is not None:
            return
        self.tracker.install()
        self._thread = threading.Thread(target=self._watch, name="meshforge-step-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self.tracker.uninstall()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """The watched part of step `step`: its computation (not its save or evaluation)."""
        if self._thread is None:
            yield
            return
        self._step, self.tracker.issued = step, 0
        self._armed_at = time.monotonic()
        self._deadline = self._armed_at + self.timeout()
        self._wake.set()
        try:
            yield
        finally:
            self._deadline = None
            self.step_times.append(time.monotonic() - self._armed_at)

    def _watch(self) -> None:
        while not self._stop:
            deadline = self._deadline
            if deadline is None:
                self._wake.wait()
                self._wake.clear()
                continue
            left = deadline - time.monotonic()
            if left > 0:
                self._wake.wait(timeout=left)
                self._wake.clear()
                continue
            if self._deadline == deadline:  # still the same step
                self._report_hang(time.monotonic() - self._armed_at)
                sys.stdout.flush()
                sys.stderr.flush()
                self.exit(HANG_EXIT_CODE)
                return

    def _report_hang(self, elapsed: float) -> None:
        tracker = self.tracker
        mine = {"step": self._step, "issued": tracker.issued, "in": tracker.in_flight}
        path = self.output_dir / f"hang-rank{self.rank}.txt"
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            with path.open("w") as file:
                file.write(
                    f"rank {self.rank} of {self.world_size}: step {self._step} running for {elapsed:.1f} s "
                    f"(training.step_timeout_s: {self.timeout():g} s)\n"
                    f"collective in flight: {tracker.in_flight or 'none'}\n"
                    f"collectives issued in this step: {tracker.issued}\n"
                    "last collectives issued (oldest first):\n"
                    + "".join(f"  {what}\n" for what in tracker.recent)
                    + "\nPython stacks of every thread:\n"
                )
                file.flush()
                faulthandler.dump_traceback(file, all_threads=True)
        except OSError as err:
            self.log(f"hang: could not write {path}: {err}")
        reports = self._exchange(mine)
        if self.rank == 0:
            self.log(self._summary(reports, elapsed))

    def _exchange(self, mine: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """Every live rank's report through the rendezvous store (the collectives are stuck)."""
        reports = {self.rank: mine}
        if self.world_size == 1 or not dist.is_initialized():
            return reports
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"meshforge/hang/{self.rank}", json.dumps(mine))
            until = time.monotonic() + _REPORT_WAIT_S
            while time.monotonic() < until and len(reports) < self.world_size:
                for rank in range(self.world_size):
                    key = f"meshforge/hang/{rank}"
                    if rank not in reports and store.check([key]):
                        reports[rank] = json.loads(store.get(key))
                time.sleep(0.1)
        except (RuntimeError, ValueError) as err:
            self.log(f"hang: the rendezvous store is unreachable ({err}); only this rank's report is known")
        return reports

    def _summary(self, reports: dict[int, dict[str, Any]], elapsed: float) -> str:
        silent = [rank for rank in range(self.world_size) if rank not in reports]
        most = max(int(report["issued"]) for report in reports.values())
        behind = sorted(rank for rank, report in reports.items() if int(report["issued"]) < most)
        waiting = sorted(rank for rank, report in reports.items() if report["in"])
        if not behind:
            behind = sorted(rank for rank, report in reports.items() if not report["in"])
        missing = sorted({*silent, *behind})
        who = f"rank(s) {', '.join(map(str, missing))} had not arrived" if missing else "every rank is stuck"
        if self.world_size == 1:
            who = "the step never returned"
        where = ""
        if waiting:
            first = reports[waiting[0]]["in"]
            where = f"; rank(s) {', '.join(map(str, waiting))} wait in {first}"
        no_report = f" ({', '.join(map(str, silent))} sent no report: dead?)" if silent else ""
        return (
            f"hang: step {self._step} ran {elapsed:.0f} s, over training.step_timeout_s {self.timeout():g} s: "
            f"{who}{no_report}{where}; stacks in {self.output_dir}/hang-rank*.txt; exiting "
            f"{HANG_EXIT_CODE} so that torchrun --max-restarts can resume the run"
        )
