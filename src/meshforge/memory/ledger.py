"""Count the bytes autograd holds for backward, to prove (and plan) activation savings.

Peak memory on the CPU is noisy (the allocator caches, other tensors live), so tests and the
planner measure what the memory features change: the activations saved for backward. A
``SavedTensorLedger`` is a ``saved_tensors_hooks`` pair that records each tensor autograd packs
(once per storage; parameters and views of them are not activations) and hands it back
unchanged. Regions that replace autograd's saving add their own share:

- a recomputed region saves only its inputs (``add``), and whatever a selective policy keeps
  (``add`` for each kept output);
- offloaded tensors are counted as ``host_bytes`` (``add_host``), not device bytes.

Inner ``saved_tensors_hooks`` (checkpoint's, swap's) take precedence over this one, which is why
those regions report to the ledger themselves through ``active_ledger()``. Works on meta tensors
too, so the planner can trace a layer without memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from meshforge.utils.distributed import local_tensor

_ACTIVE: list[SavedTensorLedger] = []


@dataclass
class SavedTensorLedger:
    """Bytes of activations saved for backward during the forwards it records.

    Attributes:
        device_bytes: Saved in the compute device's memory (unique storages).
        host_bytes: Moved to host memory by activation swap.
    """

    device_bytes: int = 0
    host_bytes: int = 0
    _seen: dict[int, list[weakref.ref[torch.Tensor]]] = field(default_factory=dict)
    _keep: list[torch.Tensor] = field(default_factory=list)
    _params: set[int] = field(default_factory=set)

    def exclude(self, params: Iterable[torch.Tensor]) -> None:
        """Never count these tensors (the model's parameters) or views of them."""
        self._params.update(id(p) for p in params)

    def _key(self, tensor: torch.Tensor) -> int | None:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) in self._params or id(tensor) in self._params or isinstance(base, nn.Parameter):
            return None
        local = local_tensor(tensor)
        storage = local.untyped_storage()
        if storage.device.type == "meta":
            # Meta storages (and those of fake tensors, whose device says cpu) have no address:
            # tell them apart by the storage object itself, kept alive with its tensor so that
            # the address is not reused while the ledger records.
            self._keep.append(local)
            return int(storage._cdata)
        return storage.data_ptr()

    def add(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as held for backward (once)."""
        key = self._key(tensor)
        if key is None:
            return
        holders = self._seen.setdefault(key, [])
        # An address seen before counts again once no tensor counted there is alive: the
        # allocator reused the memory of a tensor the forward freed.
        counted = any(ref() is not None for ref in holders)
        holders.append(weakref.ref(tensor))
        if not counted:
            self.device_bytes += local_tensor(tensor).untyped_storage().nbytes()

    def add_host(self, nbytes: int) -> None:
        """Count bytes an offload moved to host memory."""
        self.host_bytes += nbytes

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add(tensor)
        return tensor

    @contextmanager
    def recording(self) -> Iterator[SavedTensorLedger]:
        """Count what autograd saves inside the block (and let memory regions report here)."""
        _ACTIVE.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            _ACTIVE.remove(self)
            self._keep.clear()


def active_ledger() -> SavedTensorLedger | None:
    """The innermost recording ledger, or None (the common case: nothing is counted)."""
    return _ACTIVE[-1] if _ACTIVE else None
