"""What one training run is made of: the parts `build_run` builds and `Trainer` holds.

The parts are grouped by purpose, each group a frozen dataclass: who and where the run is
(`RunEnv`), the model and what was decided with it (`ModelParts`), the data (`RunData`), what
updates and saves the weights (`OptimParts`) and what watches the steps (`Watchers`). Frozen
means a part is never replaced once built; the parts themselves (an optimizer, a loader) keep
their own state. The one mutable piece is `Progress`, the loop's position, which the checkpoint
saver reads when it writes `trainer_state.json`. `TrainSummary` is what the loop reports at the
end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from meshforge.train.health import StepVerdict

if TYPE_CHECKING:
    import logging

    import torch.nn as nn
    from transformers import PreTrainedTokenizerBase

    from meshforge.checkpoint.manager import CheckpointManager
    from meshforge.config import TrainConfig
    from meshforge.data.build import LoaderContext
    from meshforge.data.loader import StatefulLoader, StreamLoader
    from meshforge.data.rampup import BatchRampUp
    from meshforge.lora.apply import LoraApplied
    from meshforge.loss.lm import LMLoss
    from meshforge.memory.apply import ActivationMemory
    from meshforge.models.common.kernels import KernelOptions
    from meshforge.models.registry import FamilySpec
    from meshforge.models.vocab import VocabPlan
    from meshforge.monitor.logger import MetricsLogger
    from meshforge.monitor.moe import MoeMonitor
    from meshforge.monitor.profiling import StepProfiler
    from meshforge.monitor.train_state import TrainStateMonitor
    from meshforge.optim.grad_accum import GradAccumulation
    from meshforge.parallel.dims import ParallelDims, ParallelMesh
    from meshforge.parallel.float8 import QuantPlan
    from meshforge.parallel.pipeline import Pipeline, PipelineSplit
    from meshforge.train.batches import BatchPlan
    from meshforge.train.callback_runner import CallbackRunner
    from meshforge.train.callbacks import BuiltinCallback
    from meshforge.train.health import StepHealth
    from meshforge.train.preemption import PreemptionGuard
    from meshforge.train.preference import PreferenceStep
    from meshforge.train.replicas import ReplicaGroup
    from meshforge.train.reward import RewardStep
    from meshforge.train.saver import CheckpointSaver
    from meshforge.utils.distributed import DistInfo

Batch = dict[str, torch.Tensor]


def tied_aliases(split: PipelineSplit | None) -> dict[str, str]:
    """Tied-weight copies this rank holds apart from their source (a pipeline's last stage)."""
    copies = split.tied_copies if split is not None else ()
    return {name: "model.embed_tokens.weight" for name in copies}


@dataclass(frozen=True)
class RunEnv:
    """Who and where the run is: config, log, process group, device, mesh, batch plan, folder."""

    cfg: TrainConfig
    log: Callable[[str], None]
    # The trainer's logger: ranks other than 0 use its warning level for the lines worth seeing.
    logger: logging.Logger
    dist: DistInfo
    device: torch.device
    dims: ParallelDims
    mesh: ParallelMesh
    plan: BatchPlan
    output_dir: Path
    # `checkpoint.load_path` as this run reads it: `auto` resolved against the folder ("" none).
    load_path: str = ""
    # A dry run's FakeTensorMode (train/dry_run.py): the model is materialised as fake tensors
    # under it, with nothing drawn or loaded; None for a real run.
    fake_tensors: AbstractContextManager[object] | None = None


@dataclass(frozen=True)
class ModelParts:
    """The parallelised, materialised model and what was decided with it."""

    module: nn.Module
    family: FamilySpec
    tokenizer: PreTrainedTokenizerBase
    vocab_plan: VocabPlan
    params_dtype: torch.dtype
    compute_dtype: torch.dtype
    kernel_options: KernelOptions
    lm_loss: LMLoss
    # The router loss counts when its coefficient is non-zero and the model offers `aux_loss()`.
    aux_coef: float
    aux_loss_enabled: bool
    mtp_coef: float
    pipeline_split: PipelineSplit | None
    fsdp: bool
    # parallelism.ignored_modules: parameters FSDP leaves alone, whose gradients the loop sums.
    ignored_params: bool
    activation_memory: ActivationMemory | None
    lora: LoraApplied | None
    # What a LoRA run's base weights are, for its checkpoints: ("hf", folder) or ("init", None).
    lora_base: tuple[str, Path | None] | None
    quant: QuantPlan | None
    num_params: int
    flops_per_token: float | None
    peak_flops: float | None

    def tied_aliases(self) -> dict[str, str]:
        """Tied-weight copies this rank holds apart from their source (see `tied_aliases`)."""
        return tied_aliases(self.pipeline_split)

    def norm_parameters(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Parameters whose gradients count in the global norm, and copies that are only clipped.

        Under pipeline parallelism a tied `lm_head.weight` on the last stage is a copy of the
        first stage's embedding with the same (summed) gradient: count it once.
        """
        params = dict(self.module.named_parameters())
        copies = set(tied_aliases(self.pipeline_split))
        counted: list[torch.Tensor] = [p for name, p in params.items() if name not in copies]
        uncounted: list[torch.Tensor] = [p for name, p in params.items() if name in copies]
        return counted, uncounted


@dataclass(frozen=True)
class RunData:
    """The train and validation loaders, their shared context, and the run's length.

    `eval_loaders` is empty without validation data; one validation set is its `MIXED_EVAL` ("")
    entry, per-dataset evaluation (`train_dataset.eval_on_each_dataset`) one entry per dataset.
    """

    loader: StatefulLoader | StreamLoader
    eval_loaders: dict[str, Iterable[Batch]]
    loader_context: LoaderContext
    total_steps: int
    rampup: BatchRampUp | None


@dataclass(frozen=True)
class OptimParts:
    """What turns gradients into updates, and what saves and restores them."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    grad_accum: GradAccumulation
    pipeline: Pipeline | None
    checkpointer: CheckpointManager


@dataclass(frozen=True)
class Watchers:
    """Health, preemption, the opt-in monitors, the sinks and the callbacks; None = switched off."""

    health: StepHealth
    preemption: PreemptionGuard
    train_state: TrainStateMonitor | None
    moe_monitor: MoeMonitor | None
    profiler: StepProfiler | None
    metrics_logger: MetricsLogger
    checkpoint_saver: CheckpointSaver
    callbacks: CallbackRunner
    # Called by the loop in this order: the saver, the profiler window, the plot.
    builtin_callbacks: list[BuiltinCallback]


@dataclass
class Progress:
    """The loop's position: the last finished step, the tokens seen, the last step's verdict."""

    step: int = 0
    tokens_seen: int = 0
    verdict: StepVerdict = field(default_factory=lambda: StepVerdict(skip=False))


@dataclass
class TrainSummary:
    """What a finished run reports (`Trainer.train`; also printed as the closing paragraph)."""

    steps: int
    final_loss: float
    tokens_per_s: float
    output_dir: Path
    last_checkpoint: Path | None
    losses: list[float] = field(default_factory=list)
    hf_export: Path | None = None
    preempted: bool = False
    # Steps of this run that never reached the weights, by reason ("non-finite", ...).
    skipped: dict[str, int] = field(default_factory=dict)
    # The step a resumed run started at when it had already reached `training.steps`.
    finished_before: int | None = None

    def closing_line(self) -> str:
        """The `Done:` paragraph the command prints for a run that was not preempted."""
        where = f"checkpoint {self.last_checkpoint}" if self.last_checkpoint else "no checkpoint saved"
        if self.finished_before is not None:
            return (
                f"Done: nothing to train: the run resumed at step {self.finished_before}, which already "
                f"reached training.steps (raise --training.steps to train further). Outputs in "
                f"{self.output_dir}; {where}."
            )
        tail = self.losses[-10:]
        smoothed = sum(tail) / len(tail) if tail else float("nan")
        first = self.losses[0] if self.losses else float("nan")
        return (
            f"Done: {self.steps} step{'' if self.steps == 1 else 's'}, final loss {self.final_loss:.4f} "
            f"(mean of the last {len(tail)}: {smoothed:.4f}; first step: {first:.4f}), "
            f"{self.tokens_per_s:,.0f} tokens/s overall. Outputs in {self.output_dir} "
            f"(config.yaml, metrics.jsonl); {where}."
            + (f" Hugging Face export in {self.hf_export}." if self.hf_export else "")
            + self.health_note()
        )

    def health_note(self) -> str:
        """'' for a run without skipped steps, else the sentence the closing line carries."""
        total = sum(self.skipped.values())
        if not total:
            return ""
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(self.skipped.items()))
        return (
            f" Warning: {total} of {self.steps} steps skipped ({reasons}); their updates were not "
            "applied (skip_reason in metrics.jsonl)."
        )


@dataclass(frozen=True)
class Run:
    """Everything `build_run` built, in the groups above, and the position the loop starts at."""

    env: RunEnv
    model: ModelParts
    data: RunData
    optim: OptimParts
    watch: Watchers
    progress: Progress
    # training.stage: dpo: the step's pair forward, reference model and metrics (train/preference.py);
    # rm: the reward model's pair forward and metrics (train/reward.py), called the same way.
    preference: PreferenceStep | RewardStep | None = None
    # parallelism.fault_tolerance: this rank's torchft replica group (train/replicas.py); None when off.
    replicas: ReplicaGroup | None = None
