"""Process-group set-up from torchrun's environment, or a one-process group otherwise.

A single process still gets a (one-rank) process group so that every code path - meshes,
DCP checkpoints, collectives in the loss - is the same with 1 or N processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_dist_info() -> DistInfo:
    """Read rank/world from torchrun's variables (defaults: one process)."""
    return DistInfo(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )


def init_process_group(backend: str, info: DistInfo, *, timeout_s: int = 1800) -> None:
    """Initialise the default process group (idempotent).

    The timeout is torch's default (30 min): the step watchdog (`train/watchdog.py`, at most 25
    min) speaks first, naming the ranks and the collective, instead of the group's bare timeout.
    """
    if dist.is_initialized():
        return
    # Read by `python -m meshforge` to leave without interpreter finalization (see __main__.py).
    dist._meshforge_used = True  # type: ignore[attr-defined]
    timeout = timedelta(seconds=timeout_s)
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        store = _attempt_store(info.world_size, timeout)
        dist.init_process_group(
            backend, store=store, rank=info.rank, world_size=info.world_size, timeout=timeout
        )
    else:
        if info.world_size != 1:
            raise RuntimeError(
                f"WORLD_SIZE={info.world_size} but MASTER_ADDR/MASTER_PORT are not set: launch with torchrun"
            )
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _attempt_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """The store of this torchrun attempt, or None to let torch make it from MASTER_ADDR/PORT.

    torchrun's agent keeps one store for every restart of a job (the shared rendezvous store),
    and torch's env:// rendezvous puts no per-attempt prefix on it: a restarted attempt's gloo
    groups can then read the address a dead worker of the previous attempt published, and fail
    with "connectFullMesh failed ... Connection refused". Prefixing the keys with the restart
    count gives each attempt keys of its own.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"meshforge/attempt_{restart}", client)


def destroy_process_group(*, synchronize: bool = True) -> None:
    """Tear the group down; with `synchronize`, first wait until every rank got here.

    Without the barrier a rank that finishes early can destroy its gloo context while a peer's
    last transfer to it is still in flight, which aborts the peer ("terminate called without an
    active exception"). Skip it on error paths, where a peer may never arrive.
    """
    if not dist.is_initialized():
        return
    if synchronize and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def all_reduce_sum(value: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum a tensor over a group (returns a new tensor; a no-op copy on one rank)."""
    out = value.detach().clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (a view that autograd and in-place
    changes flow through), any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def host_backend() -> str:
    """The backend of a process group for host-side votes and metadata: gloo, or the default
    group's own when that is torch's fake group (a dry run, `train/dry_run.py`, makes no real
    groups)."""
    if dist.is_initialized() and dist.get_backend() == "fake":
        return "fake"
    return "gloo"
