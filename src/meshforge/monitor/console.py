"""What rank 0 shows on the terminal while training.

On a terminal: a live progress bar (step, loss, tokens/s, time left) refreshed every step, with
a permanent line every `training.log_interval` steps printed above it. Without a terminal (CI,
`| tee`, log files): only the permanent lines, so logs stay readable.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from meshforge.monitor.metrics import format_step_line


class ConsoleProgress:
    """Progress display for one run of `total` steps starting after `start` steps."""

    def __init__(
        self, *, total: int, start: int, interval: int, emit: Callable[[str], None], live: bool
    ) -> None:
        self.total = total
        self.interval = max(1, interval)
        self.emit = emit
        self._progress: Any = None
        if live:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeRemainingColumn(),
                console=Console(file=sys.stdout),
                transient=True,
            )
            self._task = self._progress.add_task("train", total=total, completed=start, stats="")
            self._progress.start()

    @staticmethod
    def wanted(is_main: bool) -> bool:
        """A live bar only for rank 0 on an interactive terminal."""
        return is_main and sys.stdout.isatty()

    def update(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        if step % self.interval == 0 or step in (1, self.total):
            line = format_step_line(record, self.total)
            if self._progress is not None:
                self._progress.console.print(line, highlight=False)
            else:
                self.emit(line)
        if self._progress is not None:
            loss = record["loss"]
            stats = (
                f"loss {'nan' if loss is None else format(loss, '.4f')} | {record['tokens_per_s']:,.0f} tok/s"
            )
            self._progress.update(self._task, completed=step, stats=stats)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
