"""`sharding_propagation_untracked`: a fake-tensor memory tracker counts a DTensor op's local
tensors, not the global-shape fakes DTensor's sharding propagation builds to learn its output."""

from __future__ import annotations

import contextlib

import torch

from meshforge.utils.fake_memory import sharding_propagation_untracked


def _peak_of_add(rows: int, untracked: bool) -> int:
    """Tracked peak of `a + b` for two [rows, 256] fp32 DTensors sharded over 8 fake ranks."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from meshforge.train.dry_run import fake_world

    with fake_world(0, 8):
        mesh = init_device_mesh("cpu", (8,))
        with FakeTensorMode(allow_non_fake_inputs=True):
            a = distribute_tensor(torch.empty(rows, 256), mesh, [Shard(0)])
            b = distribute_tensor(torch.empty(rows, 256), mesh, [Shard(0)])
            tracker = MemTracker()
            with tracker, sharding_propagation_untracked() if untracked else contextlib.nullcontext():
                out = a + b
            del out
            peak = tracker.get_tracker_snapshot("peak")
    return max(int(s.get("Total", 0)) for s in peak.values())


def test_global_shape_fakes_are_not_counted() -> None:
    local = (1 << 14) // 8 * 256 * 4  # one [rows / 8, 256] fp32 shard
    # Distinct shapes: DTensor caches the propagation per shape, so each call propagates afresh.
    counted = _peak_of_add(1 << 14, untracked=False)
    untracked = _peak_of_add((1 << 14) + 8, untracked=True)
    assert counted >= 16 * local  # the global-shape inputs and output of the propagation: 24 shards
    assert untracked < 2 * local  # the local output alone
