"""Validation through the pipeline schedule (pp > 1); the plain path is `meshforge.train.evaluation`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from meshforge.loss.cross_entropy import count_valid_tokens
from meshforge.utils import distributed as dist_utils

if TYPE_CHECKING:
    from meshforge.parallel.pipeline import Pipeline

Batch = dict[str, torch.Tensor]


def evaluate_pipeline(
    pipeline: Pipeline,
    loader: Iterable[Batch],
    *,
    group_size: int,
    max_batches: int | None,
    device: torch.device,
    loss_group: dist.ProcessGroup,
    to_device: Callable[[Batch], Batch],
) -> dict[str, float]:
    """Global valid-token mean CE over `loader`, `group_size` batches per schedule call.

    The schedule was built for `group_size` micro-batches (the training accumulation), so the
    last group is filled up with copies whose labels are all ignored (they add no loss and no
    tokens).
    """
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    group: list[Batch] = []

    def flush() -> None:
        tokens = sum(int(count_valid_tokens(mb["labels"])) for mb in group)
        while len(group) < group_size:
            filler = {k: v.clone() for k, v in group[0].items()}
            filler["labels"].fill_(-100)
            group.append(filler)
        with torch.no_grad():
            totals[0] += pipeline.evaluate(group).to(torch.float64)
        totals[1] += tokens
        group.clear()

    for index, batch in enumerate(loader):
        if max_batches is not None and index >= max_batches:
            break
        group.append(to_device(batch))
        if len(group) == group_size:
            flush()
    if group:
        flush()
    totals = dist_utils.all_reduce_sum(totals, loss_group)
    loss_sum, tokens = (float(v) for v in totals.cpu())
    return {"eval_loss": loss_sum / tokens if tokens > 0 else math.nan, "eval_tokens": float(int(tokens))}


def reshard_fsdp(model: nn.Module) -> None:
    """Reshard every FSDP unit: a forward without backward leaves the root's weights gathered."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
