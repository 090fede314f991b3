"""A bad step run again from the same state and data: a real divergence, or a transient fault.

A step whose loss or gradient norm is not finite, or whose norm is above
`monitor.health_checkpoint`'s threshold, is skipped (`train/health.py`). Such a step can be the
model's own doing (the same data gives the same result) or a fault of the hardware (a bit flipped
in a kernel, a link that corrupted a message: the result changes). With `training.rerun_mode:
validate_results` (the default; Megatron-LM's `--rerun-mode` of the same name), the loop computes
the step a second time before deciding: the gradients are cleared, every RNG goes back to its
state at the start of the step, the same micro-batches run forward and backward again. The same
loss and norm (bitwise; both non-finite counts as the same): a real divergence, skipped as
before. A different result: a transient fault, logged with the ranks whose own loss changed; the
rerun's result stands (applied when healthy, skipped otherwise). The rerun costs one step, on bad
steps only; capturing the RNG state costs microseconds per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class StepResult:
    """One computation of a step: what the health decision and the step record read."""

    loss_sum: torch.Tensor  # this rank's loss sum (before the division by the normalizer)
    loss: float  # the global loss
    grad_norm: float
    embedding_norm: float | None
    extra: dict[str, float | str]


def _same(first: float, again: float) -> bool:
    """Bitwise equal, or both not finite (a NaN never equals itself)."""
    if not math.isfinite(first) or not math.isfinite(again):
        return not math.isfinite(first) and not math.isfinite(again)
    return first == again


def reproduced(first: StepResult, again: StepResult) -> bool:
    return _same(first.loss, again.loss) and _same(first.grad_norm, again.grad_norm)


def ranks_that_changed(first: StepResult, again: StepResult, device: torch.device) -> list[int]:
    """Collective: the ranks whose own loss sum differs between the two computations."""
    mine = float(first.loss_sum.detach().float().sum()), float(again.loss_sum.detach().float().sum())
    changed = torch.tensor([0.0 if _same(*mine) else 1.0], dtype=torch.float64, device=device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [0] if changed.item() else []
    every = [torch.empty_like(changed) for _ in range(dist.get_world_size())]
    dist.all_gather(every, changed)
    return [rank for rank, flag in enumerate(every) if flag.item()]


def rerun_line(step: int, first: StepResult, again: StepResult, changed: list[int], *, real: bool) -> str:
    """The log line of a rerun."""
    seen = f"loss {first.loss:.6g} / grad norm {first.grad_norm:.6g}"
    if real:
        return f"step {step}: the rerun reproduces {seen}: a real divergence (training.rerun_mode)"
    where = f"rank(s) {', '.join(map(str, changed))}" if changed else "no rank's own loss changed"
    return (
        f"step {step}: transient fault: {seen}, then loss {again.loss:.6g} / grad norm "
        f"{again.grad_norm:.6g} on the rerun ({where}); the rerun's result stands (training.rerun_mode)"
    )
