"""`TrainConfig`: the root of a run's configuration, composing every section model.

Each section is defined beside the component that consumes it (DESIGN.md: ownership); this
module only composes them. Unlike the MindFormers code, unknown top-level keys are errors.
"""

from __future__ import annotations

from pydantic import model_validator

from meshforge.checkpoint.config import CheckpointConfig
from meshforge.config.base import DTYPE_ALIASES, StrictSection, describe
from meshforge.data.config import TrainDatasetConfig
from meshforge.infer.config import InferenceConfig
from meshforge.memory.config import RecomputeCommConfig, RecomputeConfig, SwapConfig
from meshforge.models.config import KernelsConfig, LoraConfig, ModelConfig
from meshforge.monitor.config import MonitorConfig
from meshforge.monitor.profiling import ProfilerConfig
from meshforge.optim.config import LrSchedulerConfig, OptimizerConfig
from meshforge.parallel.config import ParallelismConfig
from meshforge.train.callbacks import CallbackConfig
from meshforge.train.config import TrainingConfig
from meshforge.utils.context_config import ContextConfig


class TrainConfig(StrictSection):
    """The whole configuration of one training run (frozen after validation)."""

    checkpoint: CheckpointConfig = describe(CheckpointConfig(), "Checkpoint saving and loading.")
    training: TrainingConfig = describe(
        TrainingConfig(), "Run length, batch sizes, clipping, seed, output folder."
    )
    parallelism: ParallelismConfig = describe(ParallelismConfig(), "Parallel layout (FSDP, TP, CP, PP, EP).")
    optimizer: OptimizerConfig = describe(OptimizerConfig(), "Optimizer type and hyper-parameters.")
    lr_scheduler: LrSchedulerConfig = describe(LrSchedulerConfig(), "Learning-rate schedule.")
    train_dataset: TrainDatasetConfig = describe(TrainDatasetConfig(), "Training data and its loader.")
    model: ModelConfig = describe(ModelConfig(), "Model family, source and hyper-parameters.")
    monitor: MonitorConfig = describe(MonitorConfig(), "Training monitors.")
    context: ContextConfig = describe(ContextConfig(), "Execution mode and device.")
    profiler: ProfilerConfig = describe(ProfilerConfig(), "Profiling window.")
    recompute: RecomputeConfig = describe(RecomputeConfig(), "Activation recomputation.")
    recompute_comm: RecomputeCommConfig = describe(
        RecomputeCommConfig(), "Communication-operator recomputation."
    )
    swap: SwapConfig = describe(SwapConfig(), "Activation offload to host memory.")
    callbacks: list[CallbackConfig] = describe([], "Extra callbacks, each {type: Name, ...constructor args}.")
    lora_config: LoraConfig | None = describe(None, "Low-rank adapters; null = full fine-tuning.")
    kernels: KernelsConfig = describe(KernelsConfig(), "Fused-kernel switches and torch.compile.")
    inference: InferenceConfig = describe(InferenceConfig(), "Generation settings for `meshforge generate`.")

    @model_validator(mode="before")
    @classmethod
    def _null_sections_are_defaults(cls, data: object) -> object:
        # `recompute:` with every child commented out is YAML null: treat it as "all defaults".
        if isinstance(data, dict):
            data = {
                k: v
                for k, v in data.items()
                if not (v is None and k in cls.model_fields and k != "lora_config")
            }
            data = _flash_alias(data)
            data = _param_dtype_alias(data)
        return data


def _flash_alias(data: dict[str, object]) -> dict[str, object]:
    """Carry `model.use_flash_attention` into `kernels.use_flash_attn` unless the latter is written.

    One switch, two spellings (the MindFormers model key and the MindSpeed kernel flag): the
    trainer reads `kernels`; a contradiction between two written values is an error in rules.py.
    """
    model, kernels = data.get("model"), data.get("kernels", {})
    if (
        isinstance(model, dict)
        and isinstance(kernels, dict)
        and isinstance(model.get("use_flash_attention"), bool)
    ):
        if "use_flash_attn" not in kernels:
            data = {**data, "kernels": {**kernels, "use_flash_attn": model["use_flash_attention"]}}
    return data


def _param_dtype_alias(data: dict[str, object]) -> dict[str, object]:
    """Carry MindSpeed's `parallelism.param_dtype` into `model.compute_dtype` unless that is written.

    MindSpeed's FSDP `param_dtype` is the dtype the unsharded parameters compute in, while the
    sharded master weights stay fp32: meshforge's `model.compute_dtype` (FSDP2's
    `MixedPrecisionPolicy.param_dtype`; autocast without FSDP). A contradiction between two
    written values is an error in rules.py.
    """
    par, model = data.get("parallelism"), data.get("model", {})
    if isinstance(par, dict) and isinstance(model, dict) and isinstance(par.get("param_dtype"), str):
        if "compute_dtype" not in model:
            data = {
                **data,
                "model": {
                    **model,
                    "compute_dtype": DTYPE_ALIASES.get(
                        par["param_dtype"].strip().lower(), par["param_dtype"]
                    ),
                },
            }
    return data


SECTIONS: tuple[str, ...] = tuple(TrainConfig.model_fields)
