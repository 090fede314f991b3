"""How one optimizer step's global batch splits over ranks and micro-batches.

Kept apart from the trainer's build steps so the batch arithmetic (DESIGN.md: GA = gbs // (dp *
lbs)) can be read and tested without building anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshforge.train.config import TrainingConfig


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch is split (DESIGN.md: GA = gbs // (dp * lbs))."""

    local_batch_size: int
    data_parallel: int
    grad_accum_steps: int

    @property
    def global_batch_size(self) -> int:
        return self.local_batch_size * self.data_parallel * self.grad_accum_steps


def plan_batches(training: TrainingConfig, data_parallel: int) -> tuple[BatchPlan, str | None]:
    """The batch plan from `TrainingConfig.accumulation_steps`, and a note when samples are dropped.

    Raises:
        ValueError: when `data_parallel * local_batch_size > global_batch_size`.
    """
    plan = BatchPlan(training.local_batch_size, data_parallel, training.accumulation_steps(data_parallel))
    note = None
    if training.gradient_accumulation_steps is None and training.global_batch_size != plan.global_batch_size:
        note = (
            f"training.global_batch_size {training.global_batch_size} is not a multiple of data-parallel "
            f"ranks ({data_parallel}) x local_batch_size ({training.local_batch_size}); using "
            f"{plan.global_batch_size} (as the reference does)"
        )
    return plan, note
