"""Global gradient-norm clipping that is correct for FSDP2/TP DTensor gradients.

Semantics (MindFormers, `training.max_norm`): compute the global L2 norm of all gradients,
then `clip_coef = max_norm / (norm + 1e-6)`; gradients are scaled by it only when it is below 1.
A non-finite norm is returned as it is and nothing is scaled: the trainer decides what to do
with such a step (skip, stop, log).

With sharded gradients the norm must cover every shard: for each device mesh, the DTensor
norm of its gradients is a partial value that `full_tensor()` reduces across that mesh (one
all-reduce per mesh, not per parameter); norms of different meshes (e.g. dense vs. expert
weights) and of plain tensors are then combined as `sqrt(sum(n_i^2))`. The result is a plain,
replicated float32 scalar tensor, the same on every rank.

Plain-tensor gradients are counted once, locally, never summed over ranks: in a data-parallel
model a plain parameter is one FSDP ignores (`parallelism.ignored_modules`), replicated on every
rank with the gradient `meshforge.parallel.fsdp.sync_ignored_grads` summed over the loss group,
so each rank's copy already is the global gradient. (A replicated DTensor is counted once too:
its norm is Replicate, `full_tensor()` leaves it as it is.)

Pipeline parallelism (not built yet) will need one more reduction: each stage holds different
parameters, so the squared norms must also be summed over the `pp` mesh.

No host synchronisation: the decision "scale or not" is made with tensor ops (a factor of
exactly 1.0 leaves gradients bitwise unchanged), so CUDA steps do not stall on `.item()`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, TypeGuard, cast

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "total_grad_norm"]

_EPS = 1e-6


def _is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    # Imported lazily: torch.distributed may be unavailable in minimal builds.
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def total_grad_norm(grads: list[torch.Tensor], *, foreach: bool | None = None) -> torch.Tensor:
    """Global L2 norm of `grads` (plain tensors and/or DTensors) as a plain float32 scalar.

    Args:
        grads: gradient tensors; DTensors may live on different meshes.
        foreach: unused for the norm (kept for signature compatibility; each tensor's norm is
            computed on its own so that CPU norms can accumulate in float64).

    Returns:
        A 0-dim float32 tensor, replicated (identical on every rank).
    """
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    by_mesh: dict[object, list[DTensor]] = {}
    plain: list[torch.Tensor] = []
    for g in grads:
        if _is_dtensor(g):
            by_mesh.setdefault(g.device_mesh, []).append(g)
        else:
            plain.append(g)
    parts: list[torch.Tensor] = []
    for group in by_mesh.values():
        # The norm of DTensors is a DTensor (torch's stubs say Tensor), Partial over the sharded
        # mesh axes; full_tensor() all-reduces it.
        parts.append(cast("DTensor", _sum_of_norms(group)).full_tensor())
    if plain:
        parts.append(_sum_of_norms(plain))
    device = parts[0].device
    total = torch.linalg.vector_norm(torch.stack([p.to(device, torch.float64) for p in parts]), 2.0)
    return total.to(torch.float32)


def _sum_of_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm over a list of tensors on one mesh (or plain), accumulated precisely.

    torch's CPU norm kernels accumulate in float32 sequentially (about 6e-6 relative error on a
    0.5M-element gradient, measured), which made the logged grad norm depend on how the tensor was
    sharded. On the CPU each tensor's norm is therefore computed in float64; accelerators reduce
    with trees and keep float32 (no float64 copy of large gradients).
    """
    norms = []
    for g in grads:
        dtype = torch.float64 if g.device.type == "cpu" else torch.float32
        norms.append(torch.linalg.vector_norm(g, 2.0, dtype=dtype).to(torch.float64))
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    *,
    foreach: bool | None = None,
    reduce_group: object | None = None,
    uncounted: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """Clip gradients in place to a global L2 norm of `max_norm`; return the pre-clip norm.

    Args:
        parameters: parameters (or one tensor) whose `.grad` to clip; those without a gradient
            are ignored. Plain tensors and FSDP2/TP DTensors are both fine.
        max_norm: `training.max_norm`, > 0.
        foreach: use the multi-tensor kernels (None: torch chooses).
        reduce_group: a process group whose ranks hold *different* parameters (the pipeline
            stages): their squared norms are summed over it.
        uncounted: parameters clipped by the same factor but left out of the norm (a pipeline
            stage's copy of a tied weight whose gradient another stage already counts).

    Returns:
        The global gradient norm before clipping: a plain 0-dim float32 tensor, the same on
        every rank. It may be inf/NaN, in which case the gradients were left untouched.

    Raises:
        ValueError: `max_norm` is not a finite number > 0.
    """
    if (
        isinstance(max_norm, bool)
        or not isinstance(max_norm, int | float)
        or not math.isfinite(max_norm)
        or max_norm <= 0
    ):
        raise ValueError(f"training.max_norm: must be a finite number > 0, got {max_norm!r}")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = total_grad_norm(grads, foreach=foreach)
    if reduce_group is not None:
        import torch.distributed as dist

        squared = norm.double() ** 2
        dist.all_reduce(squared, group=reduce_group)
        norm = squared.sqrt().to(norm.dtype)
    grads += [p.grad for p in uncounted if p.grad is not None]
    if not grads:
        return norm
    coef = max_norm / (norm + _EPS)
    # Scale only when clipping is needed and the norm is finite; otherwise multiply by exactly 1.
    coef = torch.where(torch.isfinite(norm) & (coef < 1.0), coef, torch.ones_like(coef))
    # One foreach call per (device, mesh): a foreach op cannot mix DTensors and plain tensors.
    buckets: dict[tuple[torch.device, object], list[torch.Tensor]] = {}
    for g in grads:
        buckets.setdefault((g.device, g.device_mesh if _is_dtensor(g) else None), []).append(g)
    for (device, _), group in buckets.items():
        factor = coef.to(device)
        if foreach is False:
            for g in group:
                g.mul_(factor)
        else:
            torch._foreach_mul_(group, factor)
    return norm
