"""Validation loss over an evaluation loader: the global valid-token mean cross-entropy.

The trainer calls `evaluate` every `training.eval_interval` steps and at the end of training, with a
`model_forward` that returns the summed cross-entropy of one batch (the same sum the training step
computes) and the loader built by `meshforge.data.build.build_eval_loader`. Loss sums and
valid-token counts are summed locally, then all-reduced once over the loss group (data and context
parallel ranks), so `eval_loss` is `sum of CE over all valid tokens / number of valid tokens`, the
same normalisation as the training loss and independent of how the samples are spread over ranks
(padding rows of the last batches carry only -100 labels and count for nothing).

Putting the model in eval mode (dropout off) and back is the caller's job: `model_forward` is a
plain callable here. Under pipeline parallelism `evaluate_pipeline` runs the schedule's forward
instead, with the same sums and the same single all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from meshforge.data.loader import IGNORE_INDEX
from meshforge.loss.cross_entropy import count_valid_tokens
from meshforge.utils import distributed as dist_utils

if TYPE_CHECKING:
    from meshforge.parallel.pipeline import Pipeline

Batch = dict[str, torch.Tensor]


def _process_group(loss_group: dist.ProcessGroup | DeviceMesh) -> dist.ProcessGroup:
    """A 1-D DeviceMesh is accepted as well as a ProcessGroup."""
    return loss_group.get_group() if isinstance(loss_group, DeviceMesh) else loss_group


def evaluate(
    model_forward: Callable[
        [dict[str, torch.Tensor]], torch.Tensor | tuple[torch.Tensor, torch.Tensor | int]
    ],
    loader: Iterable[dict[str, torch.Tensor]],
    *,
    device: torch.device | str,
    loss_group: dist.ProcessGroup | DeviceMesh | None = None,
    max_batches: int | None = None,
) -> dict[str, float]:
    """Mean cross-entropy per valid token over `loader` (one pass from its start), all ranks together.

    Args:
        model_forward: batch (on `device`) -> summed cross-entropy of its valid tokens (a scalar
            tensor), or a `(ce_sum, valid_tokens)` pair when the forward counts the tokens itself
            (e.g. after sharding the batch for context parallelism).
        loader: the evaluation batches (`EvalLoader`: each iteration starts from the first sample).
        device: where batches are moved before `model_forward`.
        loss_group: the group (or 1-D DeviceMesh) over which sums are all-reduced: every data- and
            context-parallel rank; None = single process.
        max_batches: stop after this many batches on every rank (None = the whole loader). All ranks
            must pass the same value, as each batch may involve collectives.

    Returns:
        `{"eval_loss": global mean CE per valid token (nan when there is none), "eval_tokens": count}`.
    """
    from meshforge.utils.distributed import all_reduce_sum

    if max_batches is not None and max_batches < 0:
        raise ValueError(f"max_batches must be >= 0 or None, got {max_batches}")
    # float64 sums: a long evaluation adds many float32 batch sums, and token counts stay exact.
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                break
            batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
            out = model_forward(batch)
            if isinstance(out, tuple):
                ce_sum, tokens = out
            else:
                ce_sum, tokens = out, (batch["labels"] != IGNORE_INDEX).sum()
            totals[0] += torch.as_tensor(ce_sum, device=device).detach().to(torch.float64)
            totals[1] += torch.as_tensor(tokens, device=device).to(torch.float64)
    if loss_group is not None:
        totals = all_reduce_sum(totals, _process_group(loss_group))
    loss_total, token_total = (float(v) for v in totals.cpu())
    return {
        "eval_loss": loss_total / token_total if token_total > 0 else math.nan,
        "eval_tokens": float(int(token_total)),
    }


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
