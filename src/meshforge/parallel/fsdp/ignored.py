"""Ignored modules under FSDP: their parameters stay whole on every data rank; their gradients are summed here."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import overload

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from meshforge.parallel.fsdp.placement import few

log = logging.getLogger(__name__)


# The attribute of the root model that lists the parameters FSDP ignores.
IGNORED_ATTR = "_meshforge_fsdp_ignored"


def mark_ignored(
    model: nn.Module,
    patterns: Sequence[str] | None,
    *,
    param_dtype: torch.dtype | None = None,
    key_path: str = "parallelism.ignored_modules",
) -> set[nn.Parameter]:
    """Resolve `ignored_modules` patterns, record the ignored names on `model`, return the params.

    The names (as `model.named_parameters()` gives them) are stored in the attribute
    `IGNORED_ATTR` of `model`, read back by `ignored_parameter_names`. With `param_dtype` set
    (FSDP mixed precision), each outermost ignored module gets hooks that run it in its
    parameters' stored dtype: its floating inputs are cast to that dtype and its floating
    outputs to `param_dtype`, as FSDP's own units do for theirs.

    Raises:
        ValueError: `<key_path>[i]: ...` for a pattern that is invalid, matches no module, or
            matches only modules without parameters; `<key_path>` when every parameter would
            be ignored (nothing left to shard).
    """
    from meshforge.utils.patterns import compile_pattern, match_modules

    if not patterns:
        setattr(model, IGNORED_ATTR, ())
        return set()
    if isinstance(patterns, str):
        raise ValueError(f"{key_path}: expected a list of module patterns, got the string {patterns!r}")
    matched = match_modules(model, list(patterns), key_path=key_path)
    for i, pattern in enumerate(patterns):
        compiled = compile_pattern(pattern)
        if not any(compiled.matches(name) and any(True for _ in m.parameters()) for name, m in matched):
            raise ValueError(
                f"{key_path}[{i}]: pattern {pattern!r} matches only modules without parameters; "
                "name the modules whose weights FSDP should leave unsharded"
            )
    params = {id(p): p for _, module in matched for p in module.parameters()}
    names = tuple(name for name, p in model.named_parameters() if id(p) in params)
    if all(id(p) in params for p in model.parameters()):
        raise ValueError(
            f"{key_path}: every parameter of the model is ignored, so FSDP has nothing to shard; "
            "ignore fewer modules or use no data-parallel sharding"
        )
    setattr(model, IGNORED_ATTR, names)
    if param_dtype is not None:
        outer = [
            (name, m) for name, m in matched if not any(name.startswith(f"{other}.") for other, _ in matched)
        ]
        for _, module in outer:
            _add_cast_hooks(module, param_dtype)
    log.info("FSDP ignores %d parameter tensors (kept whole on every rank): %s", len(names), few(names))
    return set(params.values())


def _add_cast_hooks(module: nn.Module, compute_dtype: torch.dtype) -> None:
    """Run an ignored module in its stored dtype between FSDP units that compute in `compute_dtype`."""
    stored = next(module.parameters()).dtype

    def cast(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: t.to(dtype) if t.is_floating_point() else t

    def before(
        _module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        return tree_map_only(torch.Tensor, cast(stored), (args, kwargs))

    def after(_module: nn.Module, _args: tuple[object, ...], output: object) -> object:
        return tree_map_only(torch.Tensor, cast(compute_dtype), output)

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after)


def ignored_parameter_names(model: nn.Module) -> tuple[str, ...]:
    """Names of the parameters FSDP was told to ignore (empty when none or not FSDP-wrapped)."""
    return tuple(getattr(model, IGNORED_ATTR, ()))


def ignored_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """`(name, parameter)` of the ignored parameters that are trained (`requires_grad`)."""
    out = [(name, model.get_parameter(name)) for name in ignored_parameter_names(model)]
    return [(name, p) for name, p in out if p.requires_grad]


def all_ignored(module: nn.Module, ignored: set[nn.Parameter]) -> bool:
    """Whether `module` has parameters and FSDP ignores all of them (then it is not a unit)."""
    ids = {id(p) for p in ignored}
    params = list(module.parameters())
    return bool(params) and all(id(p) in ids for p in params)


@torch.no_grad()
def sync_ignored_grads(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Sum the gradients of FSDP-ignored parameters over `group` (bucketed: one collective per dtype).

    FSDP reduce-scatters the gradients of the parameters it shards, but leaves ignored ones as
    each rank computed them from its own micro-batches. Call this after the backward of every
    micro-batch of a step and before clipping, with the loss group (the data-parallel and
    context-parallel ranks): the trainer divides the loss by the global token count, so the sum
    over ranks is the global gradient, the same on every rank. A parameter with a gradient on
    some ranks only gets zeros added for the others; one with no gradient on any rank keeps None
    (a presence flag travels in the same buffer). DTensor parameters (e.g. under tensor
    parallelism) have their local tensors summed.

    Args:
        model: the model `apply_fsdp`/`apply_fsdp_patterns` marked.
        group: process group to sum over; None = the default group.

    Returns:
        The number of parameters whose gradients were summed (0 when nothing is ignored).
    """
    params = [p for _, p in ignored_parameters(model)]
    if not params:
        return 0
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    buckets: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
    for p in params:
        local = p.to_local() if isinstance(p, DTensor) else p
        buckets.setdefault((local.device, local.dtype), []).append(p)
    synced = 0
    for (device, dtype), bucket in buckets.items():
        pieces: list[torch.Tensor] = []
        flags = torch.zeros(len(bucket), device=device, dtype=dtype)
        for i, p in enumerate(bucket):
            grad = _local(p.grad)
            if grad is None:
                pieces.append(torch.zeros(_local(p).numel(), device=device, dtype=dtype))
            else:
                pieces.append(grad.reshape(-1).to(dtype))
                flags[i] = 1
        flat = torch.cat([*pieces, flags])
        if world > 1:
            dist.all_reduce(flat, group=group)
        # Reading the flags back is a host sync: only needed when this rank lacks a gradient.
        missing = any(p.grad is None for p in bucket)
        present = flat[-len(bucket) :].tolist() if missing else [1.0] * len(bucket)
        offset = 0
        for p, piece, flag in zip(bucket, pieces, present, strict=True):
            summed = flat[offset : offset + piece.numel()]
            offset += piece.numel()
            if flag == 0:
                continue
            synced += 1
            _store_grad(p, summed)
    return synced


@overload
def _local(t: torch.Tensor) -> torch.Tensor: ...
@overload
def _local(t: None) -> None: ...
@overload
def _local(t: torch.Tensor | None) -> torch.Tensor | None: ...
def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def _store_grad(param: nn.Parameter, summed: torch.Tensor) -> None:
    """Write a summed flat gradient back into `param.grad`, creating it where this rank had none."""
    local_param = _local(param)
    grad = _local(param.grad)
    if grad is not None:
        grad.copy_(summed.view_as(grad))
        return
    value = summed.view(local_param.shape).clone()
    if isinstance(param, DTensor):
        value = DTensor.from_local(
            value,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    param.grad = value
