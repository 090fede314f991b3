"""`monitor:` section: health checks, train-state norms, TensorBoard and MoE load monitoring (light).

The MoE monitor keeps the reference's exact type rules: a bool is rejected in either field (a
TypeError in the reference), `save_tokens_per_expert_interval` must be > 0, and `target_layers` is
an int > 0, a list of ints >= 0, or null.
"""

from __future__ import annotations

from typing import Any

from pydantic import field_validator

from meshforge.config.base import Bool, Float, Int, NonNegInt, PosInt, StrictSection, describe


class HealthCheckpointConfig(StrictSection):
    """Thresholds of the training-health checks."""

    embedding_local_norm_threshold: Float = describe(
        100.0, "Warn when the embedding's local gradient norm exceeds this."
    )
    global_norm_skip_threshold: Float = describe(
        100.0, "Skip the step when the global gradient norm exceeds this."
    )
    global_norm_skip_time: NonNegInt = describe(10, "Abort after this many consecutive skipped steps.")


class TrainStateConfig(StrictSection):
    """Per-parameter/per-device norm and loss logging."""

    local_norm: Bool | str | list[str] = describe(
        "", "Log local gradient norms: true, a name pattern, or a list of patterns."
    )
    local_loss: Bool = describe(False, "Log each rank's local loss.")
    device_norm: Bool = describe(False, "Log per-device gradient norms.")
    device_loss: Bool = describe(False, "Log per-device losses.")


class TensorboardConfig(StrictSection):
    """TensorBoard scalars."""

    output_dir: str = describe("", "TensorBoard log folder; empty = TensorBoard off.")
    log_interval: PosInt = describe(1, "Write scalars every this many steps.")
    queue_size: PosInt = describe(1000, "Event queue size of the writer.")


def _no_bool(value: Any, field: str) -> Any:
    if isinstance(value, bool) or (isinstance(value, list) and any(isinstance(v, bool) for v in value)):
        raise ValueError(f"a boolean is not allowed for {field}, got {value!r}")
    return value


class MoeMonitorConfig(StrictSection):
    """Tokens-per-expert logging for MoE models."""

    save_tokens_per_expert_interval: Int | None = describe(
        None, "Record tokens per expert every this many steps; null = off."
    )
    target_layers: Int | list[Int] | None = describe(
        None, "Layers monitored: an int N > 0 (first N) or a list of layer indices."
    )

    @field_validator("save_tokens_per_expert_interval", mode="before")
    @classmethod
    def _interval_type(cls, value: Any) -> Any:
        return _no_bool(value, "save_tokens_per_expert_interval")

    @field_validator("target_layers", mode="before")
    @classmethod
    def _layers_type(cls, value: Any) -> Any:
        return _no_bool(value, "target_layers")

    @field_validator("save_tokens_per_expert_interval")
    @classmethod
    def _interval(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError(f"must be > 0 or null, got {value}")
        return value

    @field_validator("target_layers")
    @classmethod
    def _layers(cls, value: int | list[int] | None) -> int | list[int] | None:
        if isinstance(value, int) and value <= 0:
            raise ValueError(f"an int must be > 0, got {value}")
        if isinstance(value, list):
            for i, layer in enumerate(value):
                if layer < 0:
                    raise ValueError(f"item [{i}] must be >= 0, got {layer}")
        return value

    def is_set(self) -> bool:
        """True when the MoE monitor is switched on."""
        return self.save_tokens_per_expert_interval is not None or self.target_layers is not None


class MonitorConfig(StrictSection):
    """Training monitors."""

    health_checkpoint: HealthCheckpointConfig = describe(
        HealthCheckpointConfig(), "Training-health thresholds."
    )
    train_state: TrainStateConfig = describe(TrainStateConfig(), "Local/device norm and loss logging.")
    tensorboard: TensorboardConfig = describe(TensorboardConfig(), "TensorBoard output.")
    moe_monitor: MoeMonitorConfig = describe(MoeMonitorConfig(), "MoE tokens-per-expert monitor.")
