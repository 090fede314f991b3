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

Several named loaders (one per evaluation dataset, `train_dataset.eval_on_each_dataset`): the local
sums of each loader are stacked and all-reduced together (`eval_metrics`), giving `eval_loss/<name>`
and `eval_tokens/<name>` per dataset and, as `eval_loss`, the token-weighted mean over all of
them: total CE over total valid tokens, the number one evaluation over the datasets mixed (concat,
unpacked) gives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from meshforge.data.context import MIXED_EVAL
from meshforge.data.loader import IGNORE_INDEX
from meshforge.loss.cross_entropy import count_valid_tokens
from meshforge.utils import distributed as dist_utils

if TYPE_CHECKING:
    from meshforge.parallel.pipeline import Pipeline

Batch = dict[str, torch.Tensor]


def _process_group(loss_group: dist.ProcessGroup | DeviceMesh) -> dist.ProcessGroup:
    """A 1-D DeviceMesh is accepted as well as a ProcessGroup."""
    return loss_group.get_group() if isinstance(loss_group, DeviceMesh) else loss_group


ModelForward = Callable[[Batch], torch.Tensor | tuple[torch.Tensor, torch.Tensor | int]]


def eval_sums(
    model_forward: ModelForward,
    loader: Iterable[Batch],
    *,
    device: torch.device | str,
    max_batches: int | None = None,
) -> torch.Tensor:
    """This rank's `[CE sum, valid tokens]` (float64) over `loader`; see `evaluate` for the arguments."""
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
    return totals


def eval_metrics(
    sums: dict[str, torch.Tensor],
    *,
    loss_group: dist.ProcessGroup | DeviceMesh | None,
    unit: str = "tokens",
) -> dict[str, float]:
    """The evaluation metrics of every named loader's local `[CE sum, tokens]`, one all-reduce for all.

    `unit` names what the loss is a mean over: `tokens`, or `pairs` for preference training (the
    sums are then pair losses and pair counts).

    Returns:
        `eval_loss` (total CE / total valid tokens; nan without any) and `eval_tokens` over all
        loaders, and `eval_loss/<name>`, `eval_tokens/<name>` for each loader with a name (the
        `MIXED_EVAL` loader has none); `eval_pairs` for `eval_tokens` with `unit="pairs"`.
    """
    names = list(sums)
    totals = torch.stack([sums[name] for name in names])
    if loss_group is not None:
        totals = dist_utils.all_reduce_sum(totals, _process_group(loss_group))
    rows = totals.cpu().tolist()
    loss_total = math.fsum(row[0] for row in rows)
    token_total = math.fsum(row[1] for row in rows)
    metrics = {"eval_loss": _mean(loss_total, token_total), f"eval_{unit}": float(int(token_total))}
    for name, (loss_sum, tokens) in zip(names, rows, strict=True):
        if name != MIXED_EVAL:
            metrics[f"eval_loss/{name}"] = _mean(loss_sum, tokens)
            metrics[f"eval_{unit}/{name}"] = float(int(tokens))
    return metrics


def eval_line(metrics: dict[str, float]) -> str:
    """The console text of `eval_metrics`: the overall loss, then each dataset's."""
    names = [key.removeprefix("eval_loss/") for key in metrics if key.startswith("eval_loss/")]
    unit = "pairs" if "eval_pairs" in metrics else "tokens"
    parts = [
        f"{key} {metrics[key]:.4f} over {int(metrics[tokens]):,} {unit}"
        for key, tokens in [("eval_loss", f"eval_{unit}")]
        + [(f"eval_loss/{name}", f"eval_{unit}/{name}") for name in names]
    ]
    if "eval_rewards/accuracies" in metrics:  # preference training
        parts.append(
            f"rewards accuracy {metrics['eval_rewards/accuracies']:.2f} "
            f"margin {metrics['eval_rewards/margins']:.4f}"
        )
    return "; ".join(parts)


def _mean(loss_sum: float, tokens: float) -> float:
    return loss_sum / tokens if tokens > 0 else math.nan


def evaluate(
    model_forward: ModelForward,
    loader: Iterable[Batch],
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
    sums = eval_sums(model_forward, loader, device=device, max_batches=max_batches)
    return eval_metrics({MIXED_EVAL: sums}, loss_group=loss_group)


def pipeline_eval_sums(
    pipeline: Pipeline,
    loader: Iterable[Batch],
    *,
    group_size: int,
    max_batches: int | None,
    device: torch.device,
    to_device: Callable[[Batch], Batch],
) -> torch.Tensor:
    """This rank's `[CE sum, valid tokens]` over `loader`, `group_size` batches per schedule call.

    The schedule was built for `group_size` micro-batches (the training accumulation), so the
    last group is filled up with copies whose labels are all ignored (they add no loss and no
    tokens). Only the last stage's sums are non-zero; the all-reduce over the loss group (which
    holds the pipeline ranks) is the caller's.
    """
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    group: list[Batch] = []

    stage_loss = pipeline.stage_loss  # a preference run counts pairs

    def flush() -> None:
        if stage_loss is not None:
            tokens = sum(int(stage_loss.units(mb)) for mb in group)
        else:
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
        batch = to_device(batch)
        if stage_loss is not None:
            batch = stage_loss.shard(batch)
        elif pipeline.eval_shard is not None:
            batch = pipeline.eval_shard(batch)
        group.append(batch)
        if len(group) == group_size:
            flush()
    if group:
        flush()
    return totals


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
    """Global valid-token mean CE over `loader` under pipeline parallelism (`pipeline_eval_sums`)."""
    sums = pipeline_eval_sums(
        pipeline, loader, group_size=group_size, max_batches=max_batches, device=device, to_device=to_device
    )
    return eval_metrics({MIXED_EVAL: sums}, loss_group=loss_group)


def reshard_fsdp(model: nn.Module) -> None:
    """Reshard every FSDP unit: a forward without backward leaves the root's weights gathered."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
