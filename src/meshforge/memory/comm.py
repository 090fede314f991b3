"""Communication recompute: gathered TP/SP inputs are gathered again in backward, not saved.

Under sequence parallelism a module such as ``self_attn`` receives its input split along the
sequence (a ``Shard(1)`` DTensor) and TP's input preparation all-gathers it; the projections
inside then save the gathered (tp times larger) tensor for their weight gradients. For each
selected module this keeps the sequence shard instead:

- a forward pre-hook, registered ahead of TP's input preparation on the module and on its
  ancestors inside the layer, records the sequence-split input it receives;
- the module's ``forward`` runs under a ``saved_tensors_hooks`` pair: the pack hook replaces
  any saved tensor that lives in the gathered input's storage by a small record pointing at
  the shard, and the unpack hook all-gathers the shard again (the same redistribution as in
  forward, so the values are bitwise the same) and rebuilds the saved view.

Every TP rank runs the same backward, so the re-gathers are issued in the same order on each.
Inside a recomputed region (``recompute``) the checkpoint already keeps nothing but the inputs,
so the hooks stand aside there. Without TP, or on the generic path (no SP: nothing is
gathered), the selected modules are checked and left alone (``config/noops.py`` warns).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshforge.memory.config import RecomputeCommConfig
from meshforge.memory.ledger import active_ledger
from meshforge.memory.names import decoder_layers, layer_indices, match_submodules, no_match_error
from meshforge.memory.recompute import in_recomputed_region

if TYPE_CHECKING:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

_RECORD = "_meshforge_comm_record"
_MARK = "_meshforge_comm_recompute"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass
class _Regather:
    """One all-gathered input: its sequence shard, and the gathered storage it replaces."""

    shard: DTensor
    storage: int
    size: torch.Size
    stride: tuple[int, ...]
    _full: weakref.ref[torch.Tensor] | None = field(default=None, repr=False)

    def full(self) -> torch.Tensor:
        """The gathered tensor again (shared by the unpacks that are alive at the same time)."""
        cached = self._full() if self._full is not None else None
        if cached is not None:
            return cached
        with torch.no_grad():
            full = self.shard.redistribute(self.shard.device_mesh, (Replicate(),)).to_local()
        if full.size() != self.size or full.stride() != self.stride:
            raise RuntimeError(
                f"recompute_comm: the re-gathered input has layout {tuple(full.size())}/{full.stride()}, "
                f"the forward's was {tuple(self.size)}/{self.stride}"
            )
        self._full = weakref.ref(full)
        return full


@dataclass(frozen=True)
class _Packed:
    """What autograd holds instead of a view of the gathered input."""

    regather: _Regather
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    spec: DTensorSpec | None  # the DTensor spec of the saved tensor, or None for a plain tensor


def _pack_hook(regather: _Regather) -> Callable[[torch.Tensor], _Packed | torch.Tensor]:
    def pack(tensor: torch.Tensor) -> _Packed | torch.Tensor:
        ledger = active_ledger()
        local = _local(tensor)
        if local.device.type != "meta" and local.untyped_storage().data_ptr() == regather.storage:
            if ledger is not None:
                ledger.add(regather.shard)
            spec = tensor._spec if isinstance(tensor, DTensor) else None
            return _Packed(regather, local.size(), local.stride(), int(local.storage_offset()), spec)
        if ledger is not None:
            ledger.add(tensor)
        return tensor

    return pack


def _unpack(packed: _Packed | torch.Tensor) -> torch.Tensor:
    if not isinstance(packed, _Packed):
        return packed
    view = packed.regather.full().as_strided(packed.size, packed.stride, packed.offset)
    if packed.spec is None:
        return view
    spec = packed.spec
    with torch.no_grad():
        return DTensor.from_local(
            view, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
        )


def _record(module: nn.Module, args: tuple[object, ...]) -> None:
    """Pre-hook ahead of TP's: remember a sequence-split first input (what TP will gather)."""
    x = args[0] if args else None
    if isinstance(x, DTensor) and any(isinstance(p, Shard) and p.dim == 1 for p in x.placements):
        module.__dict__[_RECORD] = [x, None]
    else:
        module.__dict__.pop(_RECORD, None)


def _forget(module: nn.Module, _args: object, _output: object) -> None:
    module.__dict__.pop(_RECORD, None)


def _regather_for(chain: list[nn.Module], x: object, key: str, verified: list[bool]) -> _Regather | None:
    """The shard the nearest recording module got, when ``x`` is its gathered form."""
    if not isinstance(x, torch.Tensor):
        return None
    local = _local(x)
    if isinstance(x, DTensor) and not all(isinstance(p, Replicate) for p in x.placements):
        return None
    for owner in chain:
        record = owner.__dict__.get(_RECORD)
        if record is None:
            continue
        shard, regather = record
        if regather is not None and regather.storage == local.untyped_storage().data_ptr():
            return regather  # another consumer of the same gathered input in this forward
        if (
            tuple(shard.shape) != tuple(local.shape)
            or local.storage_offset() != 0
            or not local.is_contiguous()
        ):
            return None
        if not verified[0]:
            # Once: the module's input must be the gathered shard itself, or re-gathering it
            # would hand backward other values (a collective, run on every TP rank alike).
            with torch.no_grad():
                same = torch.equal(shard.full_tensor(), local)
            if not same:
                raise ValueError(
                    f"{key}: the input of this module is not the all-gathered sequence of "
                    "its parent's input; name a module that reads it directly (e.g. attention.qkv)"
                )
            verified[0] = True
        regather = _Regather(shard, local.untyped_storage().data_ptr(), local.size(), local.stride())
        record[1] = regather
        return regather
    return None


def _wrap(module: nn.Module, chain: list[nn.Module], key: str) -> None:
    original = module.forward
    verified = [False]

    @functools.wraps(original)
    def forward(*args: object, **kwargs: object) -> object:
        if not torch.is_grad_enabled() or in_recomputed_region() or not args:
            return original(*args, **kwargs)
        regather = _regather_for(chain, args[0], key, verified)
        if regather is None:
            raise ValueError(
                f"{key}: the input of {type(module).__name__} is not an all-gathered sequence, so "
                "there is nothing to gather again; name the module that reads the gathered input "
                "(attention.qkv, attention, mlp)"
            )
        with torch.autograd.graph.saved_tensors_hooks(_pack_hook(regather), _unpack):
            return original(*args, **kwargs)

    module.forward = forward
    module.__dict__[_MARK] = True


def apply_comm_recompute(
    model: nn.Module,
    cfg: RecomputeCommConfig,
    *,
    num_layers: int,
    tp_mesh: DeviceMesh | None,
    sequence_parallel: bool = False,
) -> dict[int, list[str]]:
    """Re-gather instead of saving the inputs of the modules ``cfg`` selects; ``layer -> paths``.

    Args:
        tp_mesh: the TP mesh, or None (no TP: the keys are checked, nothing is gathered).
        sequence_parallel: whether TP splits the hidden states along the sequence (the
            caller applied TP and says so); without it nothing is gathered either.

    Raises:
        ValueError: a layer beyond ``num_layers`` or a module key that matches nothing in a
            listed layer (naming ``recompute_comm.select_module.<key>``); on a module's first
            forward, when its input is not the all-gathered sequence.
    """
    layers = dict(decoder_layers(model))
    # TP without sequence parallelism (the generic path) gathers nothing: only check the keys.
    gathered = tp_mesh is not None and sequence_parallel
    applied: dict[int, list[str]] = {}
    recorders: set[int] = set()
    for key, specs in (cfg.select_module or {}).items():
        path_key = f"recompute_comm.select_module.{key}"
        wanted = layer_indices(specs)
        beyond = sorted(i for i in wanted if i >= num_layers)
        if beyond:
            raise ValueError(f"{path_key}: layer {beyond[0]} is out of range [0, {num_layers - 1}]")
        for index in sorted(wanted & layers.keys()):
            layer = layers[index]
            found = match_submodules(layer, key, key=path_key)
            if not found:
                raise no_match_error(path_key, key, layer, [index])
            if not gathered:
                continue
            for sub, module in found:
                if module.__dict__.get(_MARK):
                    continue
                # The module and its ancestors inside the layer, nearest first: where TP gathers.
                parts = sub.split(".")
                chain = [layer.get_submodule(".".join(parts[:n])) for n in range(len(parts), 0, -1)]
                for owner in chain:
                    if id(owner) not in recorders:
                        owner.register_forward_pre_hook(_record, prepend=True)
                        owner.register_forward_hook(_forget)
                        recorders.add(id(owner))
                _wrap(module, chain, path_key)
                applied.setdefault(index, []).append(sub)
    return applied
