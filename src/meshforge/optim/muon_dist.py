"""Newton-Schulz on sharded matrices: each matrix is orthogonalised whole, by one owner rank.

Newton-Schulz needs the whole matrix, but FSDP2 holds row shards (DTensor `Shard(0)`) and TP
column or row shards. Gathering every matrix on every rank would move world-size times the
model per step and repeat the same iterations on every rank. Instead, for every parameter whose
matrix dimensions (the last two) are sharded over some mesh dimensions:

1. the ranks that hold the pieces of one matrix (the mesh dimensions that shard the last two
   tensor dimensions, at this rank's coordinate on the others) form its group;
2. one rank of that group owns the matrix; owners are assigned greedily, largest matrices first,
   each to the member with the least work so far (balanced round-robin by size);
3. the members `gather` their local pieces to the owner (each piece is sent once), the owner
   assembles the matrix, orthogonalises it, and `scatter`s each member's piece of the result.

Leading dimensions stay local: a `[E, out, in]` experts weight sharded over EP (`Shard(0)`) is a
batch of whole expert matrices on each rank, orthogonalised there without any communication;
with expert-FSDP (`Shard(1)` too) the experts of one EP rank are gathered over the expert-FSDP
group only. Parameters that are not sharded in their last two dimensions (one process,
replicated meshes) are orthogonalised locally.

Each rank's piece is located by `compute_local_shape_and_global_offset` (DTensor's own layout
rule, uneven shards included); the pieces' shapes and offsets are exchanged once, at the first
step. Every member runs the same collectives in the same parameter order (the order of the
optimizer's groups), so groups of different parameters never interleave differently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["MatrixOrthogonalizer"]


@dataclass
class _Owned:
    """How one sharded parameter's matrices travel: group, owner and every member's piece."""

    group: dist.ProcessGroup
    members: list[int]  # global ranks, in group-rank order
    me: int  # index of this rank in members
    owner: int  # index of the owner in members
    shapes: list[tuple[int, ...]]  # each member's local shape
    slices: list[tuple[slice, ...]]  # each member's piece inside the owner's block
    block: tuple[int, ...]  # local leading dims + the whole matrix
    work: int  # elements of the block


def _matrix_mesh_dims(param: DTensor) -> list[int]:
    # FSDP2 over TP-sharded rows uses `_StridedShard`, which is not a `Shard` subclass.
    ndim = param.dim()
    mesh = param.device_mesh
    return [
        i
        for i, pl in enumerate(param.placements)
        if isinstance(pl, Shard | _StridedShard) and pl.dim >= ndim - 2 and mesh.size(i) > 1
    ]


class MatrixOrthogonalizer:
    """Applies a Newton-Schulz function to the updates of `params` (plain tensors or DTensors).

    Attributes:
        bytes_sent: bytes this rank has sent in gathers and scatters so far.
        owned: how many sharded matrices (parameters) this rank orthogonalises per step.
    """

    def __init__(self, params: Sequence[Tensor]) -> None:
        self._params = list(params)
        self._plans: dict[int, _Owned | None] | None = None
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.bytes_sent = 0
        self.owned = 0

    # ------------------------------------------------------------------ plan

    def _group(self, param: DTensor, dims: list[int]) -> dist.ProcessGroup:
        mesh = param.device_mesh
        if len(dims) == 1:
            return mesh.get_group(dims[0])
        coord = mesh.get_coordinate()
        assert coord is not None
        index = tuple(slice(None) if i in dims else c for i, c in enumerate(coord))
        ranks = tuple(sorted(int(r) for r in mesh.mesh[index].flatten().tolist()))
        if ranks not in self._groups:
            # Only the members call it: other pipeline stages build other groups, in another order.
            group = dist.new_group(list(ranks), use_local_synchronization=True)
            assert group is not None
            self._groups[ranks] = group
        return self._groups[ranks]

    def _plan_one(self, param: Tensor) -> _Owned | None:
        if not isinstance(param, DTensor):
            return None
        dims = _matrix_mesh_dims(param)
        if not dims:
            return None
        group = self._group(param, dims)
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        mine = torch.tensor([*shape, *offset], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(group.size())]
        dist.all_gather(everyone, mine, group=group)
        ndim = param.dim()
        lead = tuple(shape[: ndim - 2])
        lead_offset = tuple(offset[: ndim - 2])
        shapes: list[tuple[int, ...]] = []
        slices: list[tuple[slice, ...]] = []
        for row in everyone:
            s, o = row[:ndim].tolist(), row[ndim:].tolist()
            if tuple(o[: ndim - 2]) != lead_offset or tuple(s[: ndim - 2]) != lead:
                raise RuntimeError(
                    f"Muon: a group of shards of a {tuple(param.shape)} weight holds different experts"
                )
            shapes.append(tuple(s))
            slices.append(
                tuple(slice(None) for _ in lead)
                + tuple(slice(o[d], o[d] + s[d]) for d in (ndim - 2, ndim - 1))
            )
        members = [dist.get_global_rank(group, i) for i in range(group.size())]
        block = (*lead, param.shape[-2], param.shape[-1])
        work = _numel(block)
        if sum(_numel(s) for s in shapes) != work:
            # The pieces must tile the block exactly (a placement read wrongly would leave holes).
            raise RuntimeError(
                f"Muon: the shards of a {tuple(param.shape)} weight ({param.placements}) over ranks "
                f"{members} do not tile its matrices"
            )
        return _Owned(group, members, members.index(dist.get_rank()), 0, shapes, slices, block, work)

    def _plan(self) -> dict[int, _Owned | None]:
        plans = {id(p): self._plan_one(p) for p in self._params}
        load: dict[tuple[int, ...], list[int]] = {}
        owned = [p for p in plans.values() if p is not None]
        # Largest first, each to the least-loaded member (ties: the lowest index); every member
        # computes the same assignment from the same list.
        for plan in sorted(owned, key=lambda p: -p.work):
            key = tuple(plan.members)
            totals = load.setdefault(key, [0] * len(plan.members))
            plan.owner = min(range(len(totals)), key=lambda i: (totals[i], i))
            totals[plan.owner] += plan.work
        self.owned = sum(1 for p in owned if p.owner == p.me)
        return plans

    # ------------------------------------------------------------------ step

    def orthogonalize(
        self, params: Sequence[Tensor], updates: Sequence[Tensor], fn: Callable[[Tensor], Tensor]
    ) -> list[Tensor]:
        """`fn` applied to each whole matrix of each update; returns this rank's local pieces.

        Args:
            params: the parameters (for their layout), a subset of those given at construction,
                in the same order on every rank of a group.
            updates: local shards of the updates, shaped like the parameters' local shards.
            fn: the orthogonalisation of a `[..., rows, cols]` tensor.
        """
        if self._plans is None:
            self._plans = self._plan()
        out: list[Tensor] = []
        for param, update in zip(params, updates, strict=True):
            plan = self._plans[id(param)]
            out.append(fn(update) if plan is None else self._owned(plan, update, fn))
        return out

    def _owned(self, plan: _Owned, update: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
        width = max(_numel(s) for s in plan.shapes)
        owner = plan.members[plan.owner]
        piece = _padded(update.reshape(-1), width)
        received = torch.empty(width, dtype=update.dtype, device=update.device)
        if plan.me == plan.owner:
            pieces = [torch.empty_like(piece) for _ in plan.members]
            dist.gather(piece, pieces, dst=owner, group=plan.group)
            full = torch.empty(plan.block, dtype=update.dtype, device=update.device)
            for buf, shape, where in zip(pieces, plan.shapes, plan.slices, strict=True):
                full[where] = buf[: _numel(shape)].view(shape)
            result = fn(full).to(update.dtype)
            back = [_padded(result[where].reshape(-1), width) for where in plan.slices]
            self.bytes_sent += sum(
                _numel(s) * update.element_size() for i, s in enumerate(plan.shapes) if i != plan.me
            )
            dist.scatter(received, back, src=owner, group=plan.group)
        else:
            self.bytes_sent += update.numel() * update.element_size()
            dist.gather(piece, None, dst=owner, group=plan.group)
            dist.scatter(received, None, src=owner, group=plan.group)
        return received[: update.numel()].view(update.shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _padded(flat: Tensor, width: int) -> Tensor:
    if flat.numel() == width:
        return flat.contiguous()
    out = flat.new_zeros(width)
    out[: flat.numel()] = flat
    return out
