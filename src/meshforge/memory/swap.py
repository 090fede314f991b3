"""Activation swap: saved tensors of selected layers/modules go to host memory until backward.

``swap.layer_swap`` names whole decoder layers, ``swap.op_swap`` one submodule (``op_name``,
resolved by :func:`meshforge.memory.names.match_submodules`) in some layers. The module's
``forward`` runs under ``torch.autograd.graph.saved_tensors_hooks``: the pack hook copies each
tensor autograd saves to host memory and hands autograd a small handle instead, so the device
copy is freed as soon as the forward drops it; the unpack hook returns the tensor on the device.

Where the bytes go:

- CUDA/NPU: a pinned host buffer, written on a side stream (the device tensor is marked as used
  by that stream, so the allocator does not reuse it before the copy ends); the fetch back runs
  on the same side stream and the compute stream waits on its event before the tensor is used.
- CPU (and meta, for the planner): a separate host tensor, so the same hooks, schedule and
  numerics run in tests (the copies are exact: losses are bitwise equal with and without swap).

Prefetch (``swap.default_prefetch`` = k): the first unpack of layer i in backward fetches layer
i's tensors and starts the fetch of layers i-1 .. i-k of the same forward, so their copies run
while layer i computes (synchronously on the CPU, in the same order).

Never swapped: parameters and views of them (they stay on the device anyway), and tensors under
``MIN_SWAP_BYTES`` (rotary tables, masks, per-token scalars: a copy costs more than it saves).
A tensor saved several times in one module forward (the input of q/k/v projections) is copied
once. The bytes copied to host are counted (``swap_bytes`` in metrics.jsonl, this rank's) and
reported to an active :class:`~meshforge.memory.ledger.SavedTensorLedger` as host bytes.

With recompute: a layer both swapped and recomputed whole is refused (``config/rules.py``).
Non-reentrant checkpoint saves only the layer inputs outside its own hooks, and the swap hooks
of a module inside the checkpointed forward take precedence over checkpoint's: the swapped
tensors would never reach the checkpoint, so the layer would not be recomputed at all (layer
swap), or be copied to host again during recomputation (op swap). Select recompute of a submodule
inside a swapped layer composes: the submodule is recomputed, its inputs and the rest swapped.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from meshforge.memory.config import SwapConfig
from meshforge.memory.ledger import active_ledger
from meshforge.memory.names import decoder_layers, layer_indices, match_submodules, no_match_error
from meshforge.memory.recompute import in_recomputed_region

if TYPE_CHECKING:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

#: Saved tensors smaller than this stay on the device.
MIN_SWAP_BYTES = 1024


def _is_parameter(tensor: torch.Tensor) -> bool:
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(tensor, nn.Parameter) or isinstance(base, nn.Parameter)


def _accelerated(device: torch.device) -> bool:
    return device.type not in ("cpu", "meta")


class _Saved:
    """One swapped storage: its host copy (bytes) and, once fetched, its device copy."""

    __slots__ = ("__weakref__", "device", "device_copy", "event", "host", "layer_pass", "uses")

    def __init__(self, storage: torch.UntypedStorage, device: torch.device, layer_pass: _LayerPass) -> None:
        self.device = device
        self.layer_pass = layer_pass
        self.uses = 0
        self.device_copy: torch.Tensor | None = None
        self.event: torch.Event | None = None
        if storage.device.type == "meta":
            # Meta or fake tensors (the planner's trace): only the size matters.
            self.host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="meta")
            return
        data = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        if _accelerated(device):
            mod = torch.get_device_module(device)
            stream = _side_stream(device)
            stream.wait_stream(mod.current_stream(device))
            self.host = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=True)
            with mod.stream(stream):
                self.host.copy_(data, non_blocking=True)
                self.event = mod.Event()
                self.event.record(stream)
            data.record_stream(stream)
        else:
            self.host = data.clone()

    def fetch(self) -> None:
        """Start copying the bytes back to the device (a no-op when already there)."""
        if self.device_copy is not None:
            return
        if _accelerated(self.device):
            mod = torch.get_device_module(self.device)
            stream = _side_stream(self.device)
            with mod.stream(stream):
                self.device_copy = torch.empty_like(self.host, device=self.device)
                self.device_copy.copy_(self.host, non_blocking=True)
                self.event = mod.Event()
                self.event.record(stream)
        else:
            self.device_copy = self.host.clone()

    def take(self) -> torch.UntypedStorage:
        """The storage on the device for one unpack; the device copy is dropped after the last."""
        self.fetch()
        data = self.device_copy
        assert data is not None
        if self.event is not None:
            mod = torch.get_device_module(self.device)
            current = mod.current_stream(self.device)
            current.wait_event(self.event)
            data.record_stream(current)
        self.uses -= 1
        if self.uses <= 0:
            # Keep the host copy: a second backward over a retained graph fetches it again.
            self.device_copy = None
        return data.untyped_storage()


@dataclass(frozen=True, eq=False)
class _View:
    """One saved tensor: which swapped storage it lives in and how it views it."""

    saved: _Saved
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    spec: DTensorSpec | None  # the DTensor spec when a DTensor was saved, else None

    def unpack(self) -> torch.Tensor:
        storage = self.saved.take()
        tensor = torch.empty(0, dtype=self.dtype, device=self.saved.device)
        tensor.set_(storage, self.offset, self.size, self.stride)
        if self.spec is None:
            return tensor
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            return DTensor.from_local(
                tensor,
                self.spec.mesh,
                self.spec.placements,
                run_check=False,
                shape=self.spec.shape,
                stride=self.spec.stride,
            )


_STREAMS: dict[torch.device, torch.Stream] = {}


def _side_stream(device: torch.device) -> torch.Stream:
    if device not in _STREAMS:
        _STREAMS[device] = torch.get_device_module(device).Stream(device)
    return _STREAMS[device]


@dataclass(eq=False)
class _LayerPass:
    """The swapped tensors of one forward of one layer (all its swapped modules)."""

    layer: int
    earlier: list[_LayerPass]
    paths: set[str] = field(default_factory=set)
    saved: list[weakref.ref[_Saved]] = field(default_factory=list)
    # StorageImpl address -> (weak ref to the storage, its copy); the weak ref tells a live
    # storage from a new one at a reused address.
    seen: dict[int, tuple[StorageWeakRef, _Saved]] = field(default_factory=dict)
    fetched: bool = False
    used: bool = False


class SwapRuntime:
    """The hooks, prefetch schedule and byte counter of one model's swap.

    Attributes:
        prefetch: Layers fetched ahead of the one backward reaches (``swap.default_prefetch``).
        moved: Bytes copied to host memory so far.
        trace: When a list, ``("use", i)`` at the first unpack of a layer's forward and
            ``("fetch", i)`` when its copies start, in order (tests read it); None = off.
    """

    def __init__(self, prefetch: int) -> None:
        self.prefetch = prefetch
        self.moved = 0
        self.trace: list[tuple[str, int]] | None = None
        self._reported = 0
        self._latest: dict[int, _LayerPass] = {}
        self._open: _LayerPass | None = None

    def take_moved(self) -> int:
        """Bytes moved to host since the last call."""
        delta = self.moved - self._reported
        self._reported = self.moved
        return delta

    def _pass_for(self, layer: int, path: str) -> _LayerPass:
        # Modules of one layer's forward share a pass until another layer (or the same module
        # again: the next micro-batch) opens one.
        current = self._open
        if current is not None and current.layer == layer and path not in current.paths:
            current.paths.add(path)
            return current
        earlier = [
            self._latest[j]
            for j in range(layer - 1, layer - 1 - self.prefetch, -1)
            if j in self._latest and not self._latest[j].fetched
        ]
        made = _LayerPass(layer=layer, earlier=earlier, paths={path})
        self._latest[layer] = made
        self._open = made
        return made

    @contextmanager
    def region(self, layer: int, path: str) -> Iterator[None]:
        """Swap what autograd saves inside the block, as part of ``layer``'s forward."""
        layer_pass = self._pass_for(layer, path)
        try:
            with torch.autograd.graph.saved_tensors_hooks(
                functools.partial(self._pack, layer_pass), self._unpack
            ):
                yield
        finally:
            # The copies are owned by autograd's graph from here on (no cycle through the pass).
            layer_pass.seen = {}

    def _pack(self, layer_pass: _LayerPass, tensor: torch.Tensor) -> torch.Tensor | _View:
        from torch.distributed.tensor import DTensor

        ledger = active_ledger()
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        if _is_parameter(tensor) or local.layout != torch.strided:
            if ledger is not None:
                ledger.add(tensor)
            return tensor
        storage = local.untyped_storage()
        if storage.nbytes() < MIN_SWAP_BYTES:
            if ledger is not None:
                ledger.add(tensor)
            return tensor
        key = storage._cdata
        known = layer_pass.seen.get(key)
        if known is not None and not known[0].expired():
            saved = known[1]
        else:
            saved = _Saved(storage, local.device, layer_pass)
            layer_pass.seen[key] = (StorageWeakRef(storage), saved)
            layer_pass.saved.append(weakref.ref(saved))
            self.moved += storage.nbytes()
            if ledger is not None:
                ledger.add_host(storage.nbytes())
        saved.uses += 1
        return _View(
            saved,
            local.dtype,
            int(local.storage_offset()),
            tuple(local.size()),
            tuple(local.stride()),
            tensor._spec if isinstance(tensor, DTensor) else None,
        )

    def _unpack(self, packed: torch.Tensor | _View) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        layer_pass = packed.saved.layer_pass
        if not layer_pass.used:
            # The first unpack of this layer's forward: fetch it (unless a later layer already
            # started that) and start the fetch of the `prefetch` layers backward reaches next.
            layer_pass.used = True
            if self.trace is not None:
                self.trace.append(("use", layer_pass.layer))
            for needed in (layer_pass, *layer_pass.earlier):
                if not needed.fetched:
                    self._fetch(needed)
            layer_pass.earlier = []
        return packed.unpack()

    def _fetch(self, layer_pass: _LayerPass) -> None:
        layer_pass.fetched = True
        if self.trace is not None:
            self.trace.append(("fetch", layer_pass.layer))
        for ref in layer_pass.saved:
            saved = ref()
            if saved is not None:
                saved.fetch()
        if self._latest.get(layer_pass.layer) is layer_pass:
            del self._latest[layer_pass.layer]


def _wrap(module: nn.Module, runtime: SwapRuntime, layer: int, path: str) -> None:
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: object, **kwargs: object) -> object:
        if not torch.is_grad_enabled() or in_recomputed_region():
            # Inside a recomputed region the checkpoint owns the saved tensors (it keeps only
            # the region's inputs, and its recomputation must see its own hooks).
            return inner(*args, **kwargs)
        with runtime.region(layer, path):
            return inner(*args, **kwargs)

    module.forward = forward


def _outermost(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    paths = [p for p, _ in found]
    return [(p, m) for p, m in found if not any(p.startswith(q + ".") for q in paths if q != p)]


def _check(cfg: SwapConfig, num_layers: int) -> None:
    if not cfg.layer_swap and not cfg.op_swap:
        raise ValueError("swap.enable: true needs swap.layer_swap or swap.op_swap to name layers to offload")
    if not 1 <= cfg.default_prefetch <= num_layers - 1:
        raise ValueError(
            f"swap.default_prefetch: must be in [1, {num_layers - 1}] for {num_layers} layers, "
            f"got {cfg.default_prefetch}"
        )
    items = [(f"swap.layer_swap[{i}].layers", it.layers) for i, it in enumerate(cfg.layer_swap or [])]
    items += [(f"swap.op_swap[{i}].layers", it.layers) for i, it in enumerate(cfg.op_swap or [])]
    for key, specs in items:
        beyond = sorted(i for i in layer_indices(specs) if i >= num_layers)
        if beyond:
            raise ValueError(f"{key}: layer {beyond[0]} is out of range [0, {num_layers - 1}]")


def build_swap(
    model: nn.Module, cfg: SwapConfig, *, num_layers: int
) -> tuple[dict[int, list[str]], SwapRuntime]:
    """:func:`apply_swap` returning the :class:`SwapRuntime` itself (tests read its trace)."""
    _check(cfg, num_layers)
    runtime = SwapRuntime(cfg.default_prefetch)
    held = dict(decoder_layers(model))
    whole = layer_indices([spec for item in cfg.layer_swap or [] for spec in item.layers])
    applied: dict[int, list[str]] = {}
    for index in sorted(whole & held.keys()):
        _wrap(held[index], runtime, index, "")
        applied[index] = [""]
    for i, item in enumerate(cfg.op_swap or []):
        key = f"swap.op_swap[{i}].op_name"
        wanted = sorted(layer_indices(item.layers) & held.keys())
        missing = []
        for index in wanted:
            found = _outermost(match_submodules(held[index], item.op_name, key=key))
            if not found:
                missing.append(index)
                continue
            if index in whole:
                continue  # the whole layer is swapped already
            for path, module in found:
                if path not in applied.setdefault(index, []):
                    _wrap(module, runtime, index, path)
                    applied[index].append(path)
        if missing:
            raise no_match_error(key, item.op_name, held[missing[0]], missing)
    return applied, runtime


def apply_swap(
    model: nn.Module, cfg: SwapConfig, *, num_layers: int
) -> tuple[dict[int, list[str]], Callable[[], int]]:
    """Offload the saved tensors ``cfg`` selects; ``(layer -> paths, bytes moved since last call)``.

    Layer specs name global layer indices; a pipeline stage wraps the ones it holds.

    Args:
        num_layers: Decoder layers of the whole model.

    Raises:
        ValueError: ``default_prefetch`` out of [1, num_layers - 1], a layer beyond the model,
            or an ``op_name`` that matches no submodule of a layer it names (the key is named).
    """
    applied, runtime = build_swap(model, cfg, num_layers=num_layers)
    return applied, runtime.take_moved
