"""The run's metric sinks as one built-in, always-on callback (rank 0).

`metrics.jsonl` (and LLaMA-Factory's `trainer_log.jsonl` with `monitor.trainer_log`), TensorBoard,
the experiment trackers (W&B, SwanLab) and the console line all
take each step's record; the trainer calls this callback directly from its `log_step` hook (it
is not one of the `callbacks:` list, whose requests the ranks agree on every step), so a run
pays nothing for it beyond the writes themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshforge.train.callbacks import BuiltinCallback

if TYPE_CHECKING:
    from meshforge.monitor.console import ConsoleProgress
    from meshforge.monitor.metrics import JsonlMetrics, TensorBoardMetrics
    from meshforge.monitor.trackers import TrackerSink
    from meshforge.monitor.trainer_log import TrainerLog


class MetricsLogger(BuiltinCallback):
    """Every step's record to each sink this rank has (none but on rank 0); closes them once."""

    config_name = "MetricsLogger (built in)"

    def __init__(
        self,
        *,
        jsonl: JsonlMetrics | None,
        tensorboard: TensorBoardMetrics | None,
        trackers: list[TrackerSink],
        console: ConsoleProgress | None,
        trainer_log: TrainerLog | None = None,
    ) -> None:
        super().__init__()
        self.trainer_log = trainer_log
        self.jsonl = jsonl
        self.tensorboard = tensorboard
        self.trackers = trackers
        self.console = console

    def on_step_end(self, record: dict[str, Any]) -> None:
        if self.jsonl is not None:
            self.jsonl.write(record)
        if self.trainer_log is not None:
            self.trainer_log.write(record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        for tracker in self.trackers:
            tracker.write(record)
        if self.console is not None:
            self.console.update(record)

    def write_expert_counts(self, lines: list[dict[str, Any]]) -> None:
        """`monitor.moe_monitor` lines of this step (TensorBoard only; the JSONL file has its own)."""
        if self.tensorboard is not None and lines:
            self.tensorboard.write_expert_counts(lines)

    def close(self) -> None:
        """Flush and close every sink (also on error paths; a second call does nothing)."""
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        if self.console is not None:
            self.console.close()
            self.console = None
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.trainer_log is not None:
            self.trainer_log.close()
            self.trainer_log = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
