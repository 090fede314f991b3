"""Preemption: SIGTERM or SIGINT asks the run to stop after the current step with a checkpoint.

A scheduler (Slurm, Kubernetes) sends SIGTERM some time before it kills a job; torchrun forwards
it to every worker, and a signal to a single rank is enough. The handler only records the
request; the loop shares it in the step's one decision all-reduce (`meshforge.train.health`), so every
rank finishes the same step, saves the same complete checkpoint and exits 0.

A second signal exits at once (status 128 + signal number), without a checkpoint. A repeat within
`REPEAT_WINDOW_S` of the first counts as the same request: Ctrl-C reaches torchrun and its
workers together, and torchrun then forwards the signal to the workers once more.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 1.0


class PreemptionGuard:
    """Turns SIGTERM/SIGINT into `requested` while installed (main thread only)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def install(self) -> None:
        """Take over the signals; a no-op outside the main thread (signals are delivered there)."""
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.signal_name is None:
            self.signal_name = name
            self._first_at = now
            # os.write: nothing here may take a lock the interrupted code could hold (logging).
            os.write(
                2,
                f"{name} received: finishing this step and saving a checkpoint (send it again to exit now)\n".encode(),
            )
            return
        if now - self._first_at < REPEAT_WINDOW_S:
            return
        os.write(2, f"{name} received again: exiting now, without a checkpoint\n".encode())
        os._exit(128 + signum)
