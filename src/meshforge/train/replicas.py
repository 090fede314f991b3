"""Replica groups over torchft (`parallelism.fault_tolerance`): training through a group's failure.

Each replica group is one job of its own (one process, or a torchrun world with FSDP inside it,
as without torchft). The groups form the data-parallel replicate dimension: group `g` reads the
data shards `g * dp + r` of `replica_groups * dp` (`data_shard`), so the groups' data are
disjoint and a run with every group up sees the global batch of a one-job run with
`replica_groups * dp` data ranks. Every rank holds a torchft `Manager` that talks to the
lighthouse (through its group's rank 0) and owns a reconfigurable process group joining rank
`r` of every live group.

A step, as the loop calls it (`train/trainer.py`, a few lines):
1. `start_step`: the quorum (which groups take part). A group that is behind the others (a
   restarted one) recovers first, synchronously: its rank `r` fetches from rank `r` of a live
   group the weights, optimizer state, LR schedule, data position and step
   (`replica_state.py`), and the loop continues at that step.
2. `sum_tokens`: the group's valid-token count summed over the live groups. The loss of each
   rank is its token-loss sum divided by this global count, so
3. `reduce_step` sums the gradients (and the loss) over the live groups: each group then holds
   exactly the gradient of the global-batch token mean, as one job over the same data would.
   (An average of per-group means would weigh a group's tokens by its own count.)
4. `should_commit`: every group votes; the optimizer steps only when the step committed. A step
   that did not commit (a peer died inside it) leaves the weights alone on that group; a group
   whose commit count falls behind recovers from a peer at the next quorum.

The health verdict (skip, `training.rerun_mode`'s recomputation) is taken from the summed loss
and the norm of the summed gradients, which are the same on every group, so every group skips or
recomputes the same step together and the managed collectives stay paired.

The first step of a fresh run waits (up to `quorum_timeout_s`) until all `replica_groups` are
in the quorum, so a run starts with its whole global batch instead of letting the first group
to arrive train alone. torchft is imported only when the section is enabled.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshforge.train.replica_state import Position, ReplicaStateFns, local_tensor

if TYPE_CHECKING:
    from torchft import Manager

    from meshforge.data.loader import StatefulLoader, StreamLoader
    from meshforge.parallel.config import FaultToleranceConfig, ParallelismConfig

REPLICA_ENV_VARS = ("REPLICA_GROUP_ID", "TORCHFT_REPLICA_ID")
LIGHTHOUSE_ENV_VAR = "TORCHFT_LIGHTHOUSE"
# How often the first step of a fresh run asks again while groups are missing.
_FIRST_QUORUM_POLL_S = 0.2


def replica_groups(parallelism: ParallelismConfig) -> int:
    """The number of replica groups the data is sharded over (1 without torchft)."""
    ft = parallelism.fault_tolerance
    return ft.replica_groups if ft.enable else 1


def replica_id(ft: FaultToleranceConfig) -> int:
    """This group's index: `parallelism.fault_tolerance.replica_id`, else the environment.

    Raises:
        ValueError: none is given, or the environment's is not an index in `[0, replica_groups)`.
    """
    if ft.replica_id is not None:
        return ft.replica_id
    for name in REPLICA_ENV_VARS:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            continue
        if not raw.isdigit() or int(raw) >= ft.replica_groups:
            raise ValueError(
                f"{name}={raw!r}: a replica group index in [0, parallelism.fault_tolerance.replica_groups="
                f"{ft.replica_groups}) is needed"
            )
        return int(raw)
    raise ValueError(
        "parallelism.fault_tolerance.replica_id: each replica group needs its index: set it, or "
        f"the environment variable {' or '.join(REPLICA_ENV_VARS)}"
    )


def data_shard(parallelism: ParallelismConfig, *, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """`(rank, size)` of this rank's data shard among every replica group's data ranks."""
    ft = parallelism.fault_tolerance
    if not ft.enable:
        return dp_rank, dp_size
    return replica_id(ft) * dp_size + dp_rank, ft.replica_groups * dp_size


def lighthouse_address(ft: FaultToleranceConfig) -> str:
    """`parallelism.fault_tolerance.lighthouse`, else `$TORCHFT_LIGHTHOUSE` (an error without either)."""
    address = ft.lighthouse or os.environ.get(LIGHTHOUSE_ENV_VAR, "")
    if not address:
        raise ValueError(
            "parallelism.fault_tolerance.lighthouse: no lighthouse address (http://host:port): set it or "
            f"${LIGHTHOUSE_ENV_VAR}; start one with `torchft_lighthouse --min_replicas 1`"
        )
    return address


class ReplicaGroup:
    """This rank's torchft manager and the step's cross-group operations (see the module docstring)."""

    def __init__(
        self,
        manager: Manager,
        *,
        replica_id: int,
        groups: int,
        first_quorum_timeout_s: float,
        fresh: bool,
        log: Callable[[str], None],
        keep_alive: object = None,
    ) -> None:
        self.manager = manager
        self.replica_id = replica_id
        self.groups = groups
        self._first_timeout_s = first_quorum_timeout_s
        self._wait_for_all = fresh
        self._log = log
        # The group's TCPStore on rank 0: torchft connects to it, so it lives as long as the manager.
        self._keep_alive = keep_alive
        self._recovered: tuple[int, int] | None = None
        self._committed = True
        self._participants = 0

    def recovered(self, old_step: int, new_step: int) -> None:
        """Called by the state loader after a recovery from a peer."""
        self._recovered = (old_step, new_step)

    def start_step(self) -> None:
        """The quorum of this step; a group that is behind recovers from a peer before returning."""
        self.manager.start_quorum()
        if self._wait_for_all:
            self._wait_for_all = False
            # A count of polls, not a clock: every rank of the group asks the same number of times.
            polls = int(self._first_timeout_s / _FIRST_QUORUM_POLL_S)
            while self.manager.num_participants() < self.groups and polls > 0:
                polls -= 1
                time.sleep(_FIRST_QUORUM_POLL_S)
                self.manager.start_quorum()
        self._participants = self.manager.num_participants()
        if self._recovered is not None:
            old, new = self._recovered
            self._recovered = None
            self._log(
                f"replica group {self.replica_id}: recovered from a live group at step {new} (was at step "
                f"{old}): weights, optimizer, schedule and data position copied; {self._participants} of "
                f"{self.groups} groups in the quorum"
            )

    def sum_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The group's valid-token count summed over the groups of this step's quorum."""
        total = tokens.to(torch.float64).reshape(1).clone()
        self._all_reduce_sum(total)
        return total.reshape(()).to(tokens.dtype)

    def sum_over_groups(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the groups of this step's quorum (a preference step's metric sums)."""
        total = tensor.detach().to(torch.float64).clone()
        self._all_reduce_sum(total)
        return total.to(tensor.dtype)

    def reduce_step(self, model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
        """Sum the gradients (in place) and the loss over the live groups; return the summed loss.

        One managed all-reduce per gradient dtype over a flat buffer of this rank's local shards,
        and one for the loss.
        """
        params = [p for p in model.parameters() if p.requires_grad]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = local_tensor(param.grad)
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            self._all_reduce_sum(flat)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        total = loss.detach().to(torch.float64).reshape(1).clone()
        self._all_reduce_sum(total)
        return total.reshape(()).to(loss.dtype)

    def should_commit(self) -> bool:
        """Every group's vote on this step; the optimizer steps only on True."""
        self._committed = bool(self.manager.should_commit())
        return self._committed

    def fields(self) -> dict[str, int | bool]:
        """This step's record entries: the groups that took part and whether the step committed."""
        return {"replicas": self._participants, "replica_committed": self._committed}

    def close(self) -> None:
        """Stop the manager's servers (the lighthouse then drops this group after its heartbeat timeout)."""
        self.manager.shutdown(wait=False)

    def _all_reduce_sum(self, tensor: torch.Tensor) -> None:
        from torch.distributed import ReduceOp

        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()


def build_replicas(
    ft: FaultToleranceConfig,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    data_parallel: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loader: StatefulLoader | StreamLoader,
    progress: Position,
    log: Callable[[str], None],
) -> ReplicaGroup | None:
    """This rank's replica group over torchft, or None when `parallelism.fault_tolerance` is off.

    Collective over the group (rank 0 opens the group's store and shares its address).

    Args:
        ft: the `parallelism.fault_tolerance` section.
        rank, world_size: this rank in its own group (its torchrun world).
        device: the run's device (NCCL across groups on CUDA, gloo otherwise).
        data_parallel: the group's data-parallel ranks (for the log line's data shards).
        model, optimizer, scheduler, loader, progress: what a recovery copies from a peer.
        log: the run's log.
    """
    if not ft.enable:
        return None
    # torchft's Rust servers log every quorum and commit at info level; RUST_LOG=info shows them.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        from torchft import Manager
        from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo
    except ImportError as err:
        raise RuntimeError(
            f"parallelism.fault_tolerance.enable needs torchft: pip install --no-deps torchft==0.2.0 ({err})"
        ) from err
    index = replica_id(ft)
    lighthouse = lighthouse_address(ft)
    host, port, store = _group_store(rank, world_size)
    timeout = timedelta(seconds=ft.timeout_s)
    # NCCL in a subprocess on accelerators: an abort after a peer's failure cannot wedge the trainer.
    pg = ProcessGroupBabyNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
    group: ReplicaGroup | None = None

    def on_loaded(old: int, new: int) -> None:
        assert group is not None
        group.recovered(old, new)

    fns = ReplicaStateFns(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader_state=loader.state_dict,
        load_loader_state=loader.load_state_dict,
        progress=progress,
        on_loaded=on_loaded,
    )
    try:
        manager = Manager(
            pg=pg,
            load_state_dict=fns.load_state_dict,
            state_dict=fns.state_dict,
            min_replica_size=ft.min_replicas,
            # Synchronous quorum: a recovering group loads the peer's state before its forward.
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
            connect_timeout=timeout,
            rank=rank,
            world_size=world_size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=lighthouse,
            # torchft reads the trailing digits as the group's index.
            replica_id=f"meshforge_replica_{index}",
            # Every group initialises the same weights from training.seed: no copy at step 0.
            init_sync=False,
        )
    except RuntimeError as err:
        if "failed to connect" not in str(err):
            raise
        raise ValueError(
            f"parallelism.fault_tolerance.lighthouse: cannot reach {lighthouse} within timeout_s "
            f"({ft.timeout_s:g} s); is the lighthouse running (torchft_lighthouse --min_replicas 1)? "
            f"torchft: {str(err).splitlines()[0]}"
        ) from err
    # A resumed group counts its commits from the checkpoint's step, as its peers do.
    manager.load_state_dict({"step": progress.step, "batches_committed": 0})
    group = ReplicaGroup(
        manager,
        replica_id=index,
        groups=ft.replica_groups,
        first_quorum_timeout_s=ft.quorum_timeout_s,
        fresh=progress.step == 0,
        log=log,
        keep_alive=store,
    )
    log(
        f"replica group {index} of {ft.replica_groups} (torchft): lighthouse {lighthouse}, at least "
        f"{ft.min_replicas} group(s) per step, data shards {index * data_parallel}..{(index + 1) * data_parallel - 1} "
        f"of {ft.replica_groups * data_parallel}"
    )
    return group


def _group_store(rank: int, world_size: int) -> tuple[str, int, dist.TCPStore | None]:
    """A TCPStore of this group's own, opened by its rank 0: `(host, port, the store on rank 0)`.

    torchft keeps its manager's address there and every group's cross-group process group
    rendezvouses on the store of the quorum's first group, so it must be reachable from the
    other groups: rank 0 advertises its host name. A store of its own (not torchrun's) holds no
    keys of an earlier torchrun attempt.
    """
    store = None
    address: list[object] = [None, None]
    if rank == 0:
        host = socket.gethostname()
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        address = [host, store.port]
    if world_size > 1:
        dist.broadcast_object_list(address, src=0)
    return str(address[0]), int(str(address[1])), store
