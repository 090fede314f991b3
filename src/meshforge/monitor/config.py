"""`monitor:` section: health checks, train-state norms, TensorBoard, MoE load monitoring and the
experiment trackers (Weights & Biases, SwanLab) (light).

The MoE monitor keeps the reference's exact type rules: a bool is rejected in either field (a
TypeError in the reference), `save_tokens_per_expert_interval` must be > 0, and `target_layers` is
an int > 0, a list of ints >= 0, or null.
"""

from __future__ import annotations

from typing import Literal

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


def _no_bool(value: object, field: str) -> object:
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
    def _interval_type(cls, value: object) -> object:
        return _no_bool(value, "save_tokens_per_expert_interval")

    @field_validator("target_layers", mode="before")
    @classmethod
    def _layers_type(cls, value: object) -> object:
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


Tracker = Literal["tensorboard", "wandb", "swanlab"]
TRACKERS: tuple[str, ...] = ("tensorboard", "wandb", "swanlab")


class WandbConfig(StrictSection):
    """Weights & Biases run (`pip install meshforge[wandb]`); on when written or named in `report_to`."""

    project: str = describe("meshforge", "W&B project.")
    name: str | None = describe(None, "Run name; null = the name of training.output_dir.")
    entity: str | None = describe(None, "W&B entity (user or team); null = the account's default.")
    mode: Literal["online", "offline", "disabled"] | None = describe(
        None, "online, offline (sync later with `wandb sync`) or disabled; null = WANDB_MODE or online."
    )
    tags: list[str] = describe([], "Tags of the run.")
    dir: str = describe("", "Folder of W&B's local files; empty = training.output_dir.")
    log_interval: PosInt = describe(1, "Log every this many steps.")


class SwanLabConfig(StrictSection):
    """SwanLab experiment (`pip install meshforge[swanlab]`); on when written or named in `report_to`."""

    project: str = describe("meshforge", "SwanLab project.")
    name: str | None = describe(None, "Experiment name; null = the name of training.output_dir.")
    workspace: str | None = describe(None, "Workspace (an organisation); null = your own.")
    mode: Literal["cloud", "local", "offline", "disabled"] | None = describe(
        None, "cloud, local, offline or disabled; null = SwanLab's default (cloud)."
    )
    tags: list[str] = describe([], "Tags of the experiment.")
    dir: str = describe("", "SwanLab's log folder; empty = {training.output_dir}/swanlog.")
    log_interval: PosInt = describe(1, "Log every this many steps.")


class MonitorConfig(StrictSection):
    """Training monitors."""

    report_to: list[Tracker] | Literal["none", "all"] | Tracker = describe(
        [],
        "Experiment trackers to log to (the HF Trainer's `report_to`): a name or a list of "
        "tensorboard, wandb, swanlab; all; none. Each one's settings are in its own section.",
    )

    health_checkpoint: HealthCheckpointConfig = describe(
        HealthCheckpointConfig(), "Training-health thresholds."
    )
    train_state: TrainStateConfig = describe(TrainStateConfig(), "Local/device norm and loss logging.")
    tensorboard: TensorboardConfig = describe(TensorboardConfig(), "TensorBoard output.")
    moe_monitor: MoeMonitorConfig = describe(MoeMonitorConfig(), "MoE tokens-per-expert monitor.")
    plot_curves: Bool = describe(
        True,
        "Draw {output_dir}/metrics.png (loss, lr, grad norm, tokens/s) when the run ends, on rank 0; "
        "MESHFORGE_PLOT=0 in the environment switches it off as well.",
    )
    trainer_log: Bool = describe(
        False,
        "Also write {output_dir}/trainer_log.jsonl on rank 0, LLaMA-Factory's per-step record "
        "(current_steps, total_steps, loss, lr, epoch, percentage, elapsed_time, remaining_time).",
    )
    plot_loss: Bool = describe(
        False,
        "Draw {output_dir}/training_loss.png when the run ends (LLaMA-Factory's plot_loss: the loss "
        "and its smoothed curve), on rank 0.",
    )
    wandb: WandbConfig = describe(WandbConfig(), "Weights & Biases run settings.")
    swanlab: SwanLabConfig = describe(SwanLabConfig(), "SwanLab experiment settings.")

    def trackers(self) -> list[str]:
        """The trackers this run logs to: named in `report_to`, or a tracker section written.

        `report_to: none` switches every tracker off, written sections included.
        """
        named = self.report_to
        if named == "none":
            return []
        if named == "all":
            chosen = set(TRACKERS)
        else:
            chosen = {named} if isinstance(named, str) else set(named)
        chosen.update(name for name in ("wandb", "swanlab") if name in self.model_fields_set)
        return [name for name in TRACKERS if name in chosen]
