"""Turn a model built on the meta device (and possibly sharded) into real, initialised tensors.

Sharded random init must give the same weights as one process: DTensor's RNG tracker does not
cover CPU meshes, so `to_empty` + in-place init on each shard would draw different numbers.
Instead every parameter is generated in full on the CPU from a generator seeded by
(seed, parameter name), and each rank keeps its own shard. The cost is one full parameter at a
time in CPU memory, never the whole model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

InitFn = Callable[[str, torch.Tensor, torch.Generator], None]


def _shared_parameters(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, name, owner module, owner name) for every parameter that aliases an earlier one."""
    first: dict[int, tuple[nn.Module, str]] = {}
    aliases: list[tuple[nn.Module, str, nn.Module, str]] = []
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) in first:
                aliases.append((module, name, *first[id(param)]))
            else:
                first[id(param)] = (module, name)
    return aliases


def parameter_seed(seed: int, fqn: str) -> int:
    """A stable per-parameter seed, identical on every rank and every run."""
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def to_empty_keeping_ties(model: nn.Module, device: torch.device | str) -> nn.Module:
    """`model.to_empty(device=...)` with shared (tied) parameters still shared afterwards.

    `to_empty` re-creates each module's parameters separately, which unties shared weights
    (e.g. tied input/output embeddings): every alias is pointed back at the first owner's tensor.
    """
    ties = _shared_parameters(model)
    model.to_empty(device=device)
    for module, name, owner, owner_name in ties:
        setattr(module, name, getattr(owner, owner_name))
    return model


@torch.no_grad()
def materialize_and_init(model: nn.Module, *, device: torch.device, seed: int, init_fn: InitFn) -> None:
    """Allocate `model`'s storage on `device` and initialise every parameter reproducibly.

    Args:
        init_fn: fills one full CPU tensor in place, given its fully qualified name and a
            seeded generator (each model family provides it).
    """
    to_empty_keeping_ties(model, device)
    for fqn, param in model.named_parameters():
        full = torch.empty(param.shape, dtype=param.dtype, device="cpu")
        generator = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, fqn))
        init_fn(fqn, full, generator)
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank holds the same full tensor, so each slices its own
            # shard locally with no communication.
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)
    reset_buffers(model)


def materialize_fake(model: nn.Module, *, device: torch.device) -> None:
    """Give `model` storage on `device` without initialising it, buffers reset.

    Called under a `FakeTensorMode` by a dry run (`train/dry_run.py`): the parameters become
    fake tensors of their real shapes and placements, so a step measures memory and records
    collectives without any value being computed.
    """
    to_empty_keeping_ties(model, device)
    reset_buffers(model)


def reset_buffers(model: nn.Module) -> None:
    """Recompute the model's derived buffers (RoPE tables, ...) after its storage moved."""
    reset = getattr(model, "reset_buffers", None)
    if callable(reset):
        reset()
