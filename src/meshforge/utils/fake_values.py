"""Host values behind fake tensors whose values a step reads to decide shapes.

Why: a dry run's tensors are fakes (shapes and dtypes, no values), but the preference stages
read their batch's values to decide shapes: which positions are labelled answer tokens
(`nonzero`, `bincount` over the segment ids) and where each sequence ends. The dry run makes its
synthetic batch on the host, turns each tensor into a fake, and keeps the host tensor beside it
(`keep`); the code that reads values asks `on_host`, which runs its function on the host values
(views of a kept tensor included: a pipeline's micro-batch split, a row slice) and hands back
fakes of the results. Outside a dry run nothing is kept and the tensors are real: `on_host`
calls the function directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

T = TypeVar("T")

# Keyed by identity (a tensor's `==` is elementwise).
_KEPT = WeakIdKeyDictionary()


def keep(fake: torch.Tensor, host: torch.Tensor) -> None:
    """Remember `host` as the values of `fake` (for as long as `fake` lives)."""
    _KEPT[fake] = host


def host_value(tensor: torch.Tensor) -> torch.Tensor | None:
    """The host values of `tensor`: itself when real, the kept tensor (or the matching view of
    the kept tensor it views) when fake, None when nothing was kept for it."""
    if not is_fake(tensor):
        return tensor
    found: torch.Tensor | None = _KEPT.get(tensor)
    if found is not None:
        return found
    base = tensor._base
    kept: torch.Tensor | None = _KEPT.get(base) if base is not None else None
    if kept is not None:
        with _disable_current_modes():  # a host view, not an op of the fake step
            return kept.as_strided(tensor.size(), tensor.stride(), tensor.storage_offset())
    return None


def on_host(fn: Callable[..., T], *tensors: torch.Tensor | None, what: str) -> T:
    """`fn(*tensors)` on the tensors' host values; tensor results come back as fakes of the
    inputs' fake mode when the inputs were fakes.

    Raises:
        NotImplementedError: a fake input with no host values (a tensor the step derived from
            the batch in a way that cannot be traced back), naming `what` needed them.
    """
    fakes = [t for t in tensors if t is not None and is_fake(t)]
    if not fakes:
        return fn(*tensors)
    hosts = []
    for tensor in tensors:
        value = None if tensor is None else host_value(tensor)
        if tensor is not None and value is None:
            raise NotImplementedError(
                f"not supported yet: a dry run of {what} here (its batch tensors were derived on the "
                "way, so their values are not known on fake tensors)"
            )
        hosts.append(value)
    mode = detect_fake_mode(fakes)
    assert mode is not None, "fake inputs come with their fake mode"
    # Outside every dispatch mode (the fake mode, a dry run's trackers): host work, not the step's.
    with _disable_current_modes():
        result = fn(*hosts)

    def to_fake(value: object) -> object:
        return mode.from_tensor(value) if isinstance(value, torch.Tensor) else value

    return tree_map(to_fake, result)
