"""What a recovering torchft replica group copies from a live peer, and how it loads it.

The state travels through torchft's checkpoint transport (HTTP between the rank of the same
index in two groups; `torch.save`/`torch.load` of the dict), so it holds plain tensors only:
each DTensor (FSDP shards inside a group) is sent as its local shard and rebuilt on arrival
against the receiving parameter's mesh and placements. Both groups have the same layout (the
same number of ranks, the same FSDP wrapping), so shard `r` of one group is shard `r` of the
other. Model and optimizer tensors are referenced, not copied: the sender's parameters do not
change before its next optimizer step, and that step needs the receiver in the managed
all-reduce first, which it joins only once the transfer is done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# A recovery state: nested dicts of plain tensors and JSON-able values.
ReplicaState = dict[str, object]


class Position(Protocol):
    """The loop's position (`train.run.Progress`), which a recovery moves to the peer's."""

    step: int
    tokens_seen: int


def _local(value: object) -> object:
    """`value` with every DTensor replaced by its local shard (recursively through dicts and lists)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_local(v) for v in value)
    return value


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The part of `param` this rank holds (the tensor itself when it is not a DTensor)."""
    return param.to_local() if isinstance(param, DTensor) else param


@dataclass
class ReplicaStateFns:
    """The two callbacks a torchft `Manager` calls: the state of a live group, and its loading.

    `on_loaded(old_step, new_step)` is told after a recovery so the loop can say so.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader_state: Callable[[], dict[str, int]]
    load_loader_state: Callable[[dict[str, int]], None]
    progress: Position
    on_loaded: Callable[[int, int], None]

    def state_dict(self) -> ReplicaState:
        """Weights, optimizer, schedule, data position and loop position of this rank."""
        return {
            "model": {name: local_tensor(p).detach() for name, p in self.model.named_parameters()},
            "optimizer": _local(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "data": self.loader_state(),
            "progress": {"step": self.progress.step, "tokens_seen": self.progress.tokens_seen},
        }

    def load_state_dict(self, state: ReplicaState) -> None:
        """Take a peer's state in place; the loop then continues at the peer's step."""
        params = dict(self.model.named_parameters())
        weights = cast(dict[str, torch.Tensor], state["model"])
        missing = sorted(set(params) - set(weights))
        if missing:
            raise RuntimeError(f"replica recovery: the peer's state lacks parameters {missing[:5]}")
        with torch.no_grad():
            for name, param in params.items():
                local_tensor(param).copy_(weights[name])
        self.optimizer.load_state_dict(cast(dict[str, object], state["optimizer"]))
        _redistribute_optimizer_state(self.optimizer)
        self.scheduler.load_state_dict(cast(dict[str, object], state["scheduler"]))
        self.load_loader_state(cast(dict[str, int], state["data"]))
        position = cast(dict[str, int], state["progress"])
        old = self.progress.step
        self.progress.step = int(position["step"])
        self.progress.tokens_seen = int(position["tokens_seen"])
        self.on_loaded(old, self.progress.step)


def _redistribute_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Turn the local shards `load_state_dict` put in the optimizer state back into DTensors.

    `Optimizer.load_state_dict` moves each value to its parameter's device and dtype but keeps
    its type; a plain shard next to a DTensor parameter would fail in the next step.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                continue
            state = optimizer.state.get(param)
            if not state:
                continue
            local_shape = param.to_local().shape
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                    if value.dim() > 0 and value.shape == local_shape:
                        state[key] = DTensor.from_local(
                            value,
                            param.device_mesh,
                            param.placements,
                            run_check=False,
                            shape=param.shape,
                            stride=param.stride(),
                        )
