"""Profiling: the `profiler:` section (light at import; torch.profiler code imports torch lazily).

Fields follow the MindFormers ProfilerConfig (step window `start_step..end_step`, inclusive, both
positive) plus homes for the MindSpeed `profile_*` switches (`record_shapes`, `export_type`,
`data_simplification`; `profile_with_cpu` maps to `profile_cpu`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, model_validator

from meshforge.config.base import Bool, Int, PosInt, StrictSection, describe, rule_error


def _level(value: Any) -> Any:
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
        "text", "Trace export format (MindSpeed profile_export_type)."
    )
    data_simplification: Bool = describe(False, "Simplify exported profiling data (MindSpeed switch).")

    @model_validator(mode="after")
    def _window(self) -> ProfilerConfig:
        if self.start_step > self.end_step:
            raise rule_error(
                "end_step", f"must be >= profiler.start_step ({self.start_step}), got {self.end_step}"
            )
        return self
