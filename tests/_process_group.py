"""A fixture for in-process trainer tests: `Trainer.setup` joins a one-rank process group, and
later tests (which check that nothing is initialised) must not inherit it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def leave_no_process_group() -> Iterator[None]:
    """Destroy a default process group that the test created (one it found is left alone)."""
    existed = dist.is_initialized()
    yield
    if not existed and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-rank gloo group for the test (a group that already exists is used and left alone)."""
    started_here = not dist.is_initialized()
    if started_here:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if started_here:
        dist.destroy_process_group()
