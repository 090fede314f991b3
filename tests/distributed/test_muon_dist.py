"""`MatrixOrthogonalizer` on DTensor layouts: each whole matrix is orthogonalised by one owner.

Spawned gloo ranks shard seeded tensors with `distribute_tensor` (even and uneven row shards,
column shards, a 2-D mesh sharding rows and columns, experts sharded over their leading dim,
and experts with their rows sharded too); the result of every rank's local piece must be the
piece of the orthogonalised whole tensor, owners must be spread over the ranks, and the bytes
sent must be one copy of each sharded matrix's remote pieces (not an all-gather).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from meshforge.optim.muon import newton_schulz
from meshforge.optim.muon_dist import MatrixOrthogonalizer
from tests._compare import rel_error
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

COEFFS = (3.4445, -4.775, 2.0315)


def _ns(t: torch.Tensor) -> torch.Tensor:
    return newton_schulz(t, COEFFS, 5, 1e-7, torch.float32)


def _cases(world: int):
    if world == 2:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
        return [
            ("rows", (12, 8), mesh, [Shard(0)]),
            ("uneven rows", (5, 7), mesh, [Shard(0)]),
            ("one row", (1, 6), mesh, [Shard(0)]),
            ("cols", (6, 10), mesh, [Shard(1)]),
            ("replicated", (6, 4), mesh, [Replicate()]),
            ("experts over ep", (4, 6, 8), mesh, [Shard(0)]),
            ("expert rows", (2, 6, 8), mesh, [Shard(1)]),
        ]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return [
        ("rows x cols", (8, 12), mesh, [Shard(0), Shard(1)]),
        ("rows x rows", (8, 6), mesh, [Shard(0), Shard(0)]),
        ("hsdp", (9, 6), mesh, [Replicate(), Shard(0)]),
        ("ep x efsdp", (4, 6, 8), mesh, [Shard(0), Shard(1)]),
    ]


def _worker(rank: int, world: int) -> None:
    torch.manual_seed(0)  # the same full tensors on every rank
    cases = _cases(world)
    fulls = [torch.randn(*shape) for _, shape, _, _ in cases]
    params = [
        distribute_tensor(full, mesh, placements) for full, (_, _, mesh, placements) in zip(fulls, cases)
    ]
    orth = MatrixOrthogonalizer(params)
    pieces = orth.orthogonalize(params, [p.to_local() for p in params], _ns)
    errors = []
    for (name, _, mesh, placements), full, param, piece in zip(cases, fulls, params, pieces, strict=True):
        want = distribute_tensor(_ns(full), mesh, placements).to_local()
        if piece.shape != want.shape or rel_error(piece, want) > 1e-5:
            errors.append(f"rank {rank}: {name}: piece differs from the whole matrix's result")
        assert isinstance(param, DTensor)
    # Owners: every rank orthogonalises some sharded matrices; bytes: remote pieces once per way.
    owned = torch.tensor([orth.owned])
    dist.all_reduce(owned)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([orth.owned]))
    if min(int(c) for c in counts) == 0:
        errors.append(f"rank {rank}: owners not spread: {[int(c) for c in counts]}")
    sent = torch.tensor([orth.bytes_sent], dtype=torch.float64)
    dist.all_reduce(sent)
    sharded_bytes = 0.0
    for (_, shape, mesh, placements), full in zip(cases, fulls, strict=True):
        dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim >= len(shape) - 2]
        if dims:
            group = 1
            for i in dims:
                group *= mesh.size(i)
            batch = 1  # mesh ways the leading (expert) dim is split: each group has its share
            for i, p in enumerate(placements):
                if isinstance(p, Shard) and p.dim < len(shape) - 2:
                    batch *= mesh.size(i)
            groups = mesh.size() // group  # independent groups (replicas or other experts)
            per_group = full.numel() * 4 / batch
            sharded_bytes += 2 * per_group * (group - 1) / group * groups  # gather + scatter
    # Uneven pieces make it approximate; an all-gather would be `world` times more.
    if not 0.6 * sharded_bytes <= sent.item() <= 1.4 * sharded_bytes:
        errors.append(f"rank {rank}: {sent.item():.0f} bytes sent, expected about {sharded_bytes:.0f}")
    assert not errors, "\n".join(errors)


def _check_fsdp_over_tp(errors: list[str]) -> None:
    """FSDP2 over TP shards: colwise rows become `_StridedShard` (not a `Shard`) on the dp dim."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 8, bias=False))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    params = list(model.parameters())
    orth = MatrixOrthogonalizer(params)
    pieces = orth.orthogonalize(params, [local for local in (p.to_local() for p in params)], _ns)
    for name, param, piece in zip(("colwise", "rowwise"), params, pieces, strict=True):
        assert isinstance(param, DTensor)
        want = DTensor.from_local(
            piece, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
        if rel_error(want, _ns(param.full_tensor())) > 1e-5:
            errors.append(f"rank {dist.get_rank()}: FSDP over TP {name} ({param.placements}) differs")


def _worker_fsdp_tp(rank: int, world: int) -> None:
    errors: list[str] = []
    _check_fsdp_over_tp(errors)
    assert not errors, "\n".join(errors)


def test_orthogonalizer_fsdp_over_tp() -> None:
    run_workers(_worker_fsdp_tp, 4)


@pytest.mark.parametrize("world", [2, 4])
def test_orthogonalizer_layouts(world: int) -> None:
    run_workers(_worker, world)
