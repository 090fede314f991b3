"""Profiling: the `profiler:` section and the torch.profiler window it describes.

Light at import (the config imports this module): torch is imported when a window starts.

Fields follow the MindFormers ProfilerConfig (step window `start_step..end_step`, inclusive, both
positive) plus homes for the MindSpeed `profile_*` switches (`record_shapes`, `export_type`,
`data_simplification`; `profile_with_cpu` maps to `profile_cpu`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BeforeValidator, model_validator

from meshforge.config.base import Bool, Int, PosInt, StrictSection, describe, rule_error
from meshforge.train.callbacks import BuiltinCallback

if TYPE_CHECKING:
    from torch.profiler import profile


def _level(value: object) -> object:
    # Numbers may be written as strings ("1"), as everywhere in the config; a bool is not a level.
    if isinstance(value, bool):
        raise ValueError(f"a boolean is not a profiler level (got {str(value).lower()}); use 0, 1 or 2")
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value


class ProfilerConfig(StrictSection):
    """A torch.profiler window over training steps."""

    enable_profiling: Bool = describe(False, "Collect a profile over [start_step, end_step].")
    start_step: PosInt = describe(1, "First profiled step (1-based, inclusive).")
    end_step: PosInt = describe(1, "Last profiled step (inclusive, >= start_step).")
    output_path: str | None = describe(None, "Folder for traces; null = `{training.output_dir}/profile`.")
    profiler_rank: list[Int] | None = describe(None, "Ranks that profile; null = all ranks.")
    profiler_level: Annotated[Literal[0, 1, 2], BeforeValidator(_level)] = describe(
        0, "Detail level 0, 1 or 2 (higher collects more)."
    )
    mstx: Bool = describe(False, "Collect lightweight mstx markers (Ascend).")
    profile_memory: Bool = describe(False, "Record tensor memory allocations.")
    profile_cpu: Bool = describe(True, "Record CPU activity.")
    with_stack: Bool = describe(True, "Record Python call stacks.")
    record_shapes: Bool = describe(False, "Record operator input shapes (MindSpeed profile_record_shapes).")
    export_type: Literal["text", "db"] = describe(
        "text",
        "text: a Chrome trace (.pt.trace.json.gz); db: a SQLite database (.db) of the same events "
        "(MindSpeed profile_export_type).",
    )
    data_simplification: Bool = describe(False, "Simplify exported profiling data (MindSpeed switch).")

    @model_validator(mode="after")
    def _window(self) -> ProfilerConfig:
        if self.start_step > self.end_step:
            raise rule_error(
                "end_step", f"must be >= profiler.start_step ({self.start_step}), got {self.end_step}"
            )
        return self


# --- the profiler over a step window (torch imported when a window is built) ------------------

LEVELS = {
    0: "CPU (and device) operator activity",
    1: "level 0 + operator input shapes and tensor memory",
    2: "level 1 + Python stacks and FLOPs estimates",
}


#: The ranges the trainer marks inside a step (`StepProfiler.phase`).
PHASES = ("forward_backward", "clip_grads", "optimizer")


class StepProfiler(BuiltinCallback):
    """A torch.profiler window over steps `start_step..end_step` (inclusive) on this rank.

    Writes `{output}/rank{r}_step{a}-{b}.pt.trace.json.gz` (a Chrome trace that Perfetto and
    TensorBoard's profiler plugin open), or with `export_type: db` `rank{r}_step{a}-{b}.db` (SQLite,
    `meshforge.monitor.profiling_db`), and logs one line with the top operators by self time.
    `profile_memory` on CUDA also dumps the allocator's memory snapshot
    (`rank{r}_step{a}-{b}.memory.pickle`, for pytorch.org/memory_viz). `mstx` on CUDA wraps each
    step and phase in an NVTX range (for Nsight Systems).

    A built-in callback of the run: it brackets each whole step, the checkpoint save included.
    """

    config_name = "profiler (built in)"

    def __init__(
        self,
        cfg: ProfilerConfig,
        *,
        rank: int,
        output_dir: Path,
        device_type: str,
        log: Callable[[str], None],
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.rank = rank
        self.device_type = device_type
        self.log = log
        self.first, self.last = cfg.start_step, cfg.end_step
        self._stem = output_dir / f"rank{rank}_step{self.first}-{self.last}"
        suffix = ".db" if cfg.export_type == "db" else ".pt.trace.json.gz"
        self.trace = self._stem.with_name(self._stem.name + suffix)
        self._prof: profile | None = None
        self._nvtx = cfg.mstx and device_type == "cuda"
        self._memory = cfg.profile_memory and device_type == "cuda"

    @classmethod
    def build(
        cls,
        cfg: ProfilerConfig,
        *,
        rank: int,
        world_size: int,
        start_step: int,
        total_steps: int,
        output_dir: Path,
        device_type: str,
        log: Callable[[str], None],
    ) -> StepProfiler | None:
        """None when profiling is off or this rank is not listed; ValueError for a window or rank
        that the run does not have (every rank checks, before the first step)."""
        if not cfg.enable_profiling:
            return None
        if cfg.end_step > total_steps:
            raise ValueError(
                f"profiler.end_step: {cfg.end_step} is past the run's last step ({total_steps}); "
                f"the window must lie in 1..{total_steps}"
            )
        if cfg.start_step <= start_step:
            raise ValueError(
                f"profiler.start_step: {cfg.start_step} is not after the resumed step {start_step}; "
                f"this run trains steps {start_step + 1}..{total_steps}"
            )
        ranks = cfg.profiler_rank
        if ranks is not None:
            missing = [r for r in ranks if not 0 <= r < world_size]
            if missing:
                raise ValueError(
                    f"profiler.profiler_rank: rank(s) {missing} do not exist (world size {world_size}: "
                    f"ranks 0..{world_size - 1}; null = all)"
                )
            if rank not in ranks:
                return None
        folder = Path(cfg.output_path) if cfg.output_path else output_dir / "profile"
        folder.mkdir(parents=True, exist_ok=True)
        return cls(cfg, rank=rank, output_dir=folder, device_type=device_type, log=log)

    @property
    def active(self) -> bool:
        return self._prof is not None

    def step_begin(self, step: int) -> None:
        """Called before step `step` (1-based) runs."""
        if step == self.first:
            self._start()
        if self._prof is not None and self._nvtx:
            import torch

            torch.cuda.nvtx.range_push(f"step {step}")

    def step_end(self, step: int) -> None:
        """Called after step `step` finished."""
        if self._prof is None:
            return
        if self._nvtx:
            import torch

            torch.cuda.nvtx.range_pop()
        self._prof.step()  # after the window's last step the schedule hands the trace to _export
        if step == self.last:
            prof, self._prof = self._prof, None
            prof.stop()

    def on_step_begin(self, step: int) -> None:
        self.step_begin(step)

    def on_step_close(self, step: int, *, save: bool, stop: bool) -> None:
        self.step_end(step)

    def phase(self, name: str) -> AbstractContextManager[object]:
        """A named range inside the window (`record_function`, plus NVTX with mstx); else nothing."""
        if self._prof is None:
            return contextlib.nullcontext()
        import torch

        stack = contextlib.ExitStack()
        stack.enter_context(torch.profiler.record_function(name))
        if self._nvtx:
            stack.enter_context(torch.cuda.nvtx.range(name))
        return stack

    def _start(self) -> None:
        import warnings

        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        cfg, level = self.cfg, self.cfg.profiler_level
        activities = []
        if cfg.profile_cpu or self.device_type == "cpu":
            activities.append(ProfilerActivity.CPU)
        if self.device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        if self._memory:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        with warnings.catch_warnings():
            # No warm-up step: the window starts recording at its first step, as configured.
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            steps = schedule(wait=0, warmup=0, active=self.last - self.first + 1, repeat=1)
        self._prof = profile(
            activities=activities,
            schedule=steps,
            on_trace_ready=self._export,
            record_shapes=cfg.record_shapes or level >= 1,
            profile_memory=cfg.profile_memory or level >= 1,
            with_stack=cfg.with_stack or level >= 2,
            with_flops=level >= 2,
        )
        self._prof.start()

    def _export(self, prof: profile) -> None:
        if self.cfg.export_type == "db":
            import torch

            from meshforge.monitor.profiling_db import export_sqlite

            meta = {
                "rank": self.rank,
                "first_step": self.first,
                "last_step": self.last,
                "device_type": self.device_type,
                "profiler_level": self.cfg.profiler_level,
                "torch": torch.__version__,
            }
            export_sqlite(prof, self.trace, meta, first_step=self.first)
        else:
            prof.export_chrome_trace(str(self.trace))
        extra = ""
        if self._memory:
            import torch

            snapshot = self._stem.with_name(self._stem.name + ".memory.pickle")
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            extra = f", memory snapshot {snapshot}"
        self.log(
            f"profiler: steps {self.first}-{self.last} on rank {self.rank} -> {self.trace}{extra}; "
            f"{self._summary(prof)}"
        )

    def _summary(self, prof: profile) -> str:
        try:
            return f"top operators by self time: {top_operators(prof, self.device_type)}"
        except UnicodeDecodeError:
            # torch's Python tracer (with_stack) keeps raw pointers to code objects; code freed
            # inside the window (a first checkpoint save imports modules there) leaves event
            # names that cannot be read back. The trace itself is already written.
            return (
                "no top operators: torch.profiler could not read back its event names "
                "(profiler.with_stack with Python code freed inside the window, as a first "
                "checkpoint save's imports; with_stack: false avoids it)"
            )

    def close(self) -> None:
        """End a window the run left early (it stopped inside it): the steps so far are written."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()


def top_operators(prof: profile, device_type: str, count: int = 5) -> str:
    """`aten::mm 12.3 ms (41%), ...`: the operators with the most self time in the window.

    On the CPU only operators (`namespace::name`) count, not the step and phase ranges or the
    Python frames `with_stack` records; on CUDA the kernels' device time.
    """
    attr = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
    events = [
        e
        for e in prof.key_averages()
        if getattr(e, attr, 0) > 0 and (device_type == "cuda" or "::" in e.key) and e.key not in PHASES
    ]
    total = sum(getattr(e, attr) for e in events) or 1
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    return (
        ", ".join(
            f"{e.key} {getattr(e, attr) / 1000:.1f} ms ({100 * getattr(e, attr) / total:.0f}%)"
            for e in events[:count]
        )
        or "none recorded"
    )
