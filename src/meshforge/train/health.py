"""Run health: whether a step's update is applied, and when a run that keeps failing stops.

Always on: a step whose loss or global gradient norm is not finite is skipped (no optimizer
update, no scheduler step; its data is consumed). With `monitor.health_checkpoint` written in
the config, a step whose pre-clip global norm exceeds `global_norm_skip_threshold` is skipped too,
and the embedding's local gradient norm is compared with `embedding_local_norm_threshold` (a
warning). After `global_norm_skip_time` consecutive skips (0: the first) the run saves the current
weights, which are those of the last applied update, and stops with `HealthStopError`.

The decision is one all-reduce (max) over the world of this rank's flags, so every rank of every
layout (data, pipeline, tensor parallel) skips or stops at the same step; a preemption request
(`meshforge.train.preemption`) travels in the same all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch import nn

    from meshforge.monitor.config import HealthCheckpointConfig

SECTION = "monitor.health_checkpoint"


class TrainingDivergedError(FloatingPointError):
    """The run cannot go on because its steps keep failing; raised on every rank at the same step.

    The message is one line for the user; the command line prints it and exits 1.
    """


class HealthStopError(TrainingDivergedError):
    """`global_norm_skip_time` consecutive steps were skipped; the last good state is saved."""


@dataclass(frozen=True)
class StepVerdict:
    """What the world decided for one step."""

    skip: bool
    reason: str = ""
    embedding_norm: float | None = None
    loss: float = math.nan
    grad_norm: float = math.nan
    preempted: bool = False


@dataclass
class _Skipped:
    step: int
    loss: float
    grad_norm: float


@dataclass
class StepHealth:
    """Per-run health state: the thresholds and the current run of consecutive skipped steps.

    Args:
        config: the `monitor.health_checkpoint` section.
        thresholds: whether the section is written; without it only non-finite steps are skipped
            (and the consecutive limit still applies to them).
        device: where the decision tensor lives (the process group's device).
    """

    config: HealthCheckpointConfig
    thresholds: bool
    device: torch.device
    _run: list[_Skipped] = field(default_factory=list)
    # Every skipped step of this run by kind of reason, for the closing summary.
    skipped: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_monitor(
        cls, config: HealthCheckpointConfig, *, written: bool, device: torch.device
    ) -> StepHealth:
        return cls(config=config, thresholds=written, device=device)

    def embedding_local_norm(self, model: nn.Module) -> float | None:
        """The pre-clip norm of this rank's part of the input embedding's gradient (None: not here).

        Only measured with the thresholds on; under pipeline parallelism only the first stage
        holds the embedding, under FSDP/TP a rank holds a shard of it ("local").
        """
        if not self.thresholds:
            return None
        weight = _embedding_weight(model)
        if weight is None or weight.grad is None:
            return None
        grad = weight.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        return float(torch.linalg.vector_norm(local.detach().to(torch.float64)))

    def decide(
        self, loss: float, grad_norm: float, embedding_norm: float | None, *, stop_requested: bool = False
    ) -> StepVerdict:
        """Reduce this rank's view of the step over the world (one all-reduce) and decide.

        `stop_requested` is this rank's preemption request (`meshforge.train.preemption`); it rides
        on the same all-reduce, so agreeing on it costs nothing.
        """
        non_finite = not (math.isfinite(loss) and math.isfinite(grad_norm))
        limit = self.config.global_norm_skip_threshold
        too_large = self.thresholds and not non_finite and grad_norm > limit
        emb = -1.0 if embedding_norm is None else embedding_norm
        if not math.isfinite(emb):
            emb = math.inf
        local = [float(non_finite), float(too_large), emb, float(stop_requested)]
        flags = torch.tensor(local, dtype=torch.float64).to(self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        any_non_finite, any_too_large, max_emb, any_stop = (float(v) for v in flags.cpu())
        seen_emb = None if max_emb < 0 else max_emb
        reason = ""
        if any_non_finite:
            reason = f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'}"
        elif any_too_large:
            reason = f"gradient norm {grad_norm:.4g} > global_norm_skip_threshold {limit:g}"
        return StepVerdict(
            skip=bool(reason),
            reason=reason,
            embedding_norm=seen_emb,
            loss=loss,
            grad_norm=grad_norm,
            preempted=any_stop > 0,
        )

    def embedding_warning(self, verdict: StepVerdict, step: int) -> str | None:
        """The warning line when the embedding's local norm exceeds its threshold, else None."""
        limit = self.config.embedding_local_norm_threshold
        if verdict.embedding_norm is None or verdict.embedding_norm <= limit:
            return None
        return (
            f"warning: step {step}: embedding local gradient norm {verdict.embedding_norm:.4g} > "
            f"{SECTION}.embedding_local_norm_threshold {limit:g}"
        )

    def record(self, verdict: StepVerdict, step: int) -> bool:
        """Count this step; True when the run must stop (too many consecutive skips)."""
        if not verdict.skip:
            self._run.clear()
            return False
        kind = "non-finite" if verdict.reason.startswith("non-finite") else "gradient norm above threshold"
        self.skipped[kind] = self.skipped.get(kind, 0) + 1
        self._run.append(_Skipped(step, verdict.loss, verdict.grad_norm))
        return len(self._run) >= self.config.global_norm_skip_time

    def stop_message(self, checkpoint: str) -> str:
        """One line: why the run stopped, the norms seen, and where the last good state is."""
        first, last = self._run[0].step, self._run[-1].step
        good_step = first - 1
        norms = ", ".join(f"{s.grad_norm:.4g}" for s in self._run[-8:])
        losses = ", ".join(f"{s.loss:.4g}" for s in self._run[-8:])
        more = " (last 8)" if len(self._run) > 8 else ""
        limit = (
            f"global_norm_skip_threshold {self.config.global_norm_skip_threshold:g}"
            if self.thresholds
            else "non-finite values only"
        )
        return (
            f"{SECTION}: {len(self._run)} consecutive steps skipped (steps {first}-{last}, "
            f"global_norm_skip_time {self.config.global_norm_skip_time}; {limit}); gradient norms{more} "
            f"[{norms}], losses [{losses}]; saved the last good state (weights after step {good_step}) "
            f"to {checkpoint}"
        )


def _embedding_weight(model: nn.Module) -> torch.Tensor | None:
    """The input embedding's weight: transformers' `embed_tokens`, or `get_input_embeddings()`."""
    for name, param in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            return param
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        module = get()
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            return weight
    return None


def finite_or_none(value: float) -> float | None:
    """A metric value for metrics.jsonl: None (JSON null) instead of NaN or infinity."""
    return value if math.isfinite(value) else None
