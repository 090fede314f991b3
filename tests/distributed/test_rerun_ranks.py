"""The rerun names the ranks whose own loss changed (2 processes, gloo)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow


def _worker(rank: int, world: int) -> list[int]:
    from meshforge.train.rerun import StepResult, ranks_that_changed

    first = StepResult(torch.tensor(2.5), float("nan"), 1.0, None, {})
    again = StepResult(torch.tensor(2.5 if rank == 0 else 2.75), 1.2, 1.0, None, {})
    return ranks_that_changed(first, again, torch.device("cpu"))


def test_the_ranks_whose_loss_changed_are_named() -> None:
    assert run_workers(_worker, 2) == [[1], [1]]
