"""Count the collectives a training step actually issues, and the bytes they carry.

Every c10d collective (FSDP's all-gathers and reduce-scatters, DTensor's functional
collectives for TP, the all-to-alls of EP and CP, pipeline send/recv) goes through the
dispatcher, so a `TorchDispatchMode` sees each one with its tensors. For each call we
record the size of its largest tensor argument: the full buffer of the operation (the
all-gather output, the reduce-scatter input, the all-reduced tensor, the all-to-all input,
the sent or received tensor). That is the volume the layout asks for, independent of the
backend's algorithm (a ring all-reduce moves about twice that over the wire).

Enabled for a run by `MESHFORGE_COMM_STATS=1`: metrics.jsonl then gains `comm_bytes` and
`comm_calls` per step (this rank's counts). The mode costs a Python call per dispatched op,
so it is off by default.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ENV_SWITCH = "MESHFORGE_COMM_STATS"
_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"})
# Ops in those namespaces that move no data.
_NOT_COLLECTIVES = ("wait_tensor", "barrier", "monitored_barrier")


def comm_stats_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip().lower() in ("1", "true", "yes", "on")


class CommCounter(TorchDispatchMode):
    """Context manager: `calls` and `bytes` per collective op name while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace in _NAMESPACES and not any(n in func.__name__ for n in _NOT_COLLECTIVES):
            name = func.__name__.split(".")[0]
            tensors = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
            self.calls[name] += 1
            self.bytes[name] += max((t.numel() * t.element_size() for t in tensors), default=0)
        return func(*args, **(kwargs or {}))

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
