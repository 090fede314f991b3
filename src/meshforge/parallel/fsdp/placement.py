"""FSDP shard placement: which dim of each parameter FSDP2 shards (built-in rules or a user function)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

PlacementFn = Callable[[nn.Parameter], Shard | None]

log = logging.getLogger(__name__)


# Built-in shard placement names (MindSpeed's two plus one of ours).
SHARD_PLACEMENTS = ("shard_by_dim_0", "shard_by_dim_1", "shard_largest_dim")


class _DimPlacement:
    """A built-in shard placement; FSDP2 calls it once per parameter of a unit.

    FSDP2 pads only dim 0 for uneven shards and refuses an uneven split of any other dim, so a
    requested dim > 0 that the shard count does not divide falls back to dim 0 (recorded in
    `fallbacks` and logged once per `apply_fsdp*` call).
    """

    def __init__(self, name: str, shard_size: int) -> None:
        self.name = name
        self.shard_size = shard_size
        self.fallbacks: list[tuple[int, ...]] = []

    def __call__(self, param: nn.Parameter) -> Shard | None:
        shape = tuple(param.shape)
        if not shape:
            return None
        if self.name == "shard_by_dim_0" or len(shape) == 1:
            return Shard(0)
        if self.name == "shard_by_dim_1":
            if shape[1] % self.shard_size == 0:
                return Shard(1)
            self.fallbacks.append(shape)
            return Shard(0)

        # shard_largest_dim: the largest dim that divides evenly (dim 0 always may), first of equals.
        def size(d: int) -> tuple[int, int]:
            return shape[d], -d

        allowed = [0, *(d for d in range(1, len(shape)) if shape[d] % self.shard_size == 0)]
        best = max(allowed, key=size)
        if best != max(range(len(shape)), key=size):
            self.fallbacks.append(shape)
        return Shard(best)

    def __repr__(self) -> str:
        return f"{self.name}(shards={self.shard_size})"


def resolve_shard_placement(
    spec: str | None,
    *,
    shard_size: int,
    key_path: str = "parallelism.shard_placement_fn",
) -> PlacementFn | None:
    """The `shard_placement_fn` FSDP2 gets for `parallelism.shard_placement_fn`.

    Args:
        spec: None (FSDP's default, dim 0); `shard_by_dim_0`; `shard_by_dim_1` (dim 1 where
            the shard count divides it, else dim 0: FSDP2 refuses uneven shards of dims > 0);
            `shard_largest_dim` (the largest dim that divides, else dim 0); or a user function
            `package.module:function` / `package.module.function` taking an `nn.Parameter` and
            returning a `torch.distributed.tensor.Shard` or None (None = dim 0).
        shard_size: the number of shards (the size of the mesh's shard axis).
        key_path: the config key, for messages.

    Returns:
        The placement function, or None for FSDP's default.

    Raises:
        ValueError: `<key_path>: ...` for an unknown name, a module that does not import, or
            an attribute that is missing or not callable.
    """
    if spec is None:
        return None
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{key_path}: expected a placement name or 'package.module:function', got {spec!r}")
    spec = spec.strip()
    if spec in SHARD_PLACEMENTS:
        return _DimPlacement(spec, shard_size)
    valid = ", ".join(SHARD_PLACEMENTS)
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        import difflib

        close = difflib.get_close_matches(spec, SHARD_PLACEMENTS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"{key_path}: unknown shard placement {spec!r}{hint}; expected one of {valid}, or a "
            "function 'package.module:function' taking a parameter and returning Shard(dim) or None"
        )
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"{key_path}: cannot import {module_name!r} for {spec!r} ({e}); expected one of {valid}, "
            "or an importable 'package.module:function'"
        ) from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{key_path}: {module_name!r} has no attribute {attr!r} (from {spec!r})")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{key_path}: {spec!r} is a {type(target).__name__}, not a function")
    return _checked_user_placement(target, spec, key_path)


def _checked_user_placement(fn: Callable[[nn.Parameter], Any], spec: str, key_path: str) -> PlacementFn:
    def placement(param: nn.Parameter) -> Shard | None:
        out = fn(param)
        if out is not None and not isinstance(out, Shard):
            raise TypeError(
                f"{key_path}: {spec} returned {out!r} for a parameter of shape {tuple(param.shape)}; "
                "expected torch.distributed.tensor.Shard(dim) or None"
            )
        return out

    placement.__name__ = spec
    return placement


def shard_size(mesh: DeviceMesh) -> int:
    # FSDP shards over the last axis of a 2-D (replicate, shard) HSDP mesh.
    return mesh.size(mesh.ndim - 1)


def log_fallbacks(placement: PlacementFn | None) -> None:
    fallbacks = getattr(placement, "fallbacks", None)
    if fallbacks:
        log.info(
            "%r: %d parameters sharded on another dim than asked (that dim does not divide into "
            "equal shards, which FSDP2 needs for dims > 0), e.g. shapes %s",
            placement,
            len(fallbacks),
            ", ".join(str(s) for s in fallbacks[:3]),
        )


def few(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")
