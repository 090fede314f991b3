"""A model rebuilt on the CPU in a one-rank process group, for offline reads and writes of checkpoints.

Both conversions (`meshforge convert`) and a pipeline run's HF export read a whole DCP step in
one process: a one-rank gloo group makes DCP take the same code path as in training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshforge.models.materialize import to_empty_keeping_ties

if TYPE_CHECKING:
    from meshforge.models.registry import FamilySpec


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A one-process gloo group for the duration (none is created when one exists)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_on_cpu(family: FamilySpec, options: dict[str, object], dtype: torch.dtype) -> torch.nn.Module:
    with torch.device("meta"):
        model = family.build(options)
    model.to(dtype=dtype)
    # Storage only: every parameter is overwritten by the load that follows. Tied weights stay
    # tied (transformers models do not re-tie after to_empty), or a tied export would carry an
    # lm_head.weight key of its own.
    return to_empty_keeping_ties(model, "cpu")
