"""How one optimizer step's global batch splits over ranks and micro-batches, and how a
micro-batch reaches the model: on the device, sliced for context parallelism, divided by the
step's loss normaliser.

Kept apart from the trainer's build steps and loop so the batch arithmetic (DESIGN.md: GA = gbs
// (dp * lbs)) can be read and tested without building anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from meshforge.utils import distributed as dist_utils

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from meshforge.train.config import TrainingConfig

Batch = dict[str, torch.Tensor]


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
    """The batch plan from `TrainingConfig.accumulation_steps` (`gradient_accumulation_steps`, or
    what a given global batch leaves), and a note when samples are dropped.

    Raises:
        ValueError: when `data_parallel * local_batch_size > global_batch_size`.
    """
    plan = BatchPlan(training.local_batch_size, data_parallel, training.accumulation_steps(data_parallel))
    note = None
    if training.global_batch_size is not None and training.global_batch_size != plan.global_batch_size:
        note = (
            f"training.global_batch_size {training.global_batch_size} is not a multiple of data-parallel "
            f"ranks ({data_parallel}) x local_batch_size ({training.local_batch_size}); using "
            f"{plan.global_batch_size} (as the reference does)"
        )
    return plan, note


def rank_mean_normalizer(
    local_tokens: torch.Tensor | int,
    *,
    data_parallel: int,
    device: torch.device,
    cp_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """The loss divisor of `parallelism.disable_gradient_division: false` (MindSpeed's averaging).

    Each data rank takes the mean over its own tokens (summed over its context-parallel ranks,
    `cp_group`, which share its rows) and the ranks are averaged: the tokens of a data rank with
    short rows weigh more, as in a DDP/HF Trainer run without token averaging. A rank without a
    valid token divides by the data-rank count, not by zero.
    """
    own = torch.as_tensor(local_tokens, device=device)
    if cp_group is not None:
        own = dist_utils.all_reduce_sum(own, cp_group)
    return own.clamp(min=1).to(torch.float32) * float(data_parallel)


def to_device(batch: Batch, device: torch.device, *, pin: bool) -> Batch:
    """Copy a batch to the device; on an accelerator from pinned memory with `pin`.

    A copy from pageable memory is synchronous whatever `non_blocking` says; pinning first lets
    it overlap with the step's compute.
    """
    if device.type == "cpu":
        return batch
    return {k: (v.pin_memory() if pin else v).to(device, non_blocking=pin) for k, v in batch.items()}


def cp_model_kwargs(cp: int) -> tuple[str, ...]:
    """Extra batch keys the CP attention needs from `shard_batch_for_cp` (none without CP)."""
    if cp == 1:
        return ()
    from meshforge.parallel.context import CP_MODEL_KWARGS

    return tuple(CP_MODEL_KWARGS)


def shard_for_cp(batch: Batch, cp_mesh: DeviceMesh, *, method: str) -> Batch:
    """This rank's part of every row of `batch` for context parallelism (`parallelism.cp_method()`)."""
    from meshforge.parallel.context import shard_batch_for_cp

    return shard_batch_for_cp(batch, cp_mesh, method=method)
