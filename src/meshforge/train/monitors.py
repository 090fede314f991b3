"""The trainer's watchers: run health, preemption, the opt-in monitors, the profiler window, and
the built-in callbacks (metrics, checkpoint saves, profiler window, plot) in their order.

Built after the rest of the run (they need the model, the mesh and the resumed step); each is None
when switched off, so a run without them pays nothing per step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from meshforge.monitor.logger import MetricsLogger
from meshforge.monitor.moe import MoeMonitor
from meshforge.monitor.profiling import StepProfiler
from meshforge.monitor.trackers import TrackerSink, build_trackers
from meshforge.monitor.train_state import TrainStateMonitor
from meshforge.train.build import TrainerBuild
from meshforge.train.health import StepHealth, StepVerdict
from meshforge.train.preemption import PreemptionGuard
from meshforge.train.saver import CheckpointSaver

if TYPE_CHECKING:
    from meshforge.train.callback_runner import CallbackRunner
    from meshforge.train.callbacks import BuiltinCallback


class TrainerMonitors(TrainerBuild):
    """Builds the watchers; the loop (`Trainer`) consults them."""

    logger: logging.Logger
    health: StepHealth
    preemption: PreemptionGuard
    train_state: TrainStateMonitor | None
    moe_monitor: MoeMonitor | None
    profiler: StepProfiler | None
    metrics_logger: MetricsLogger
    callbacks: CallbackRunner
    builtin_callbacks: list[BuiltinCallback]
    checkpoint_saver: CheckpointSaver
    _verdict: StepVerdict
    _moe_lines: list[dict[str, Any]]

    def _build_metrics_logger(self) -> None:
        """The sinks as the built-in `MetricsLogger`; W&B / SwanLab runs start here, on rank 0,
        given the resolved config (their packages were checked in setup)."""
        trackers: list[TrackerSink] = []
        if self.dist.is_main:
            config = self.cfg.model_dump(mode="json")
            trackers = build_trackers(
                self.cfg.monitor, output_dir=self.output_dir, config=config, resuming=self.step > 0
            )
        self.metrics_logger = MetricsLogger(
            jsonl=self.jsonl, tensorboard=self.tensorboard, trackers=trackers, console=self.console
        )

    def _build_monitors(self) -> None:
        """Run health, preemption, the opt-in monitors and the profiler (collective: gathers names)."""
        monitor = self.cfg.monitor
        self.health = StepHealth.from_monitor(
            monitor.health_checkpoint,
            written="health_checkpoint" in monitor.model_fields_set,
            device=self.device,
        )
        self._verdict = StepVerdict(skip=False)
        self._moe_lines = []
        self.preemption = PreemptionGuard()
        self.train_state = TrainStateMonitor.build(
            monitor.train_state,
            self.model,
            rank=self.dist.rank,
            world=self.dist.world_size,
            pp=self.dims.pp,
            device=self.device,
            skip=self.pipeline_split.tied_copies if self.pipeline_split is not None else (),
        )
        self.moe_monitor = MoeMonitor.build(
            monitor.moe_monitor,
            self.model,
            log_interval=self.cfg.training.log_interval,
            world=self.dist.world_size,
            tp=self.dims.tp,
            device=self.device,
            output_dir=self.output_dir if self.dist.is_main else None,
            resume_step=self.step,
        )
        if self.moe_monitor is not None and self.pipeline is not None:
            for stage in self.pipeline.stages:
                self.moe_monitor.ignore_inside(stage, "_forward_metadata_inference")
        self.profiler = StepProfiler.build(
            self.cfg.profiler,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            start_step=self.step,
            total_steps=self.total_steps,
            output_dir=self.output_dir,
            device_type=self.device.type,
            # Other ranks' info lines are muted: a profiled rank's summary is worth a line anyway.
            log=self.log if self.dist.is_main else self.logger.warning,
        )
        self.checkpoint_saver = CheckpointSaver(
            self.checkpointer,
            model=self.model,
            optimizer=self.optimizer,
            trainer_state=self._trainer_state,
            preempted=lambda: self._verdict.preempted,
            total_steps=self.total_steps,
            log=self.log,
            on_save=lambda path: self.callbacks.call("on_save", path),
        )
        # The order of the step's decisions: the save before the profiler's end of the step (the
        # window brackets the whole step, save included); the plot (from setup) at the end.
        profiler = [self.profiler] if self.profiler is not None else []
        self.builtin_callbacks = [self.checkpoint_saver, *profiler, *self.builtin_callbacks]

    def _trainer_state(self) -> dict[str, Any]:
        """What `trainer_state.json` of a checkpoint holds besides model and optimizer."""
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "scheduler": self.scheduler.state_dict(),
            "data": self.loader.state_dict(),
            "world_size": self.dist.world_size,
            "global_batch_size": self.plan.global_batch_size,
        }
