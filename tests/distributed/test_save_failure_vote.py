"""A write that fails on one rank only: both ranks name it and take the same way on (2 processes, gloo).

Rank 1's RNG file cannot be written (a local write, before DCP's collective): without the vote
rank 0 would enter DCP's save alone and wait for rank 1 for the length of the group timeout.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow


def _worker(rank: int, world: int, root: str) -> list[str]:
    import meshforge.checkpoint.save_failure as save_failure_module

    # Each rank reads another free space (as two nodes' disks would): the line names the failing rank's.
    real_free = save_failure_module.free_space
    save_failure_module.free_space = lambda _path: f"{rank + 1}00.0 MiB free"  # type: ignore[assignment]
    try:
        return _saves(rank, root)
    finally:
        save_failure_module.free_space = real_free


def _saves(rank: int, root: str) -> list[str]:
    import meshforge.checkpoint.manager as manager_module
    from meshforge.checkpoint.integrity import damage
    from meshforge.checkpoint.manager import CheckpointManager
    from meshforge.checkpoint.save_failure import CheckpointSaveError
    from meshforge.utils.seed import rng_state

    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    results: list[str] = []
    real_write = manager_module.write_rng_file
    for policy in ("continue", "stop"):
        save_dir = Path(root) / policy
        logged: list[str] = []
        manager = CheckpointManager(
            save_dir=save_dir, prefix="checkpoint", interval=1, keep=None, enabled=True,
            save_optimizer=True, rank=rank, log=logged.append, on_save_error=policy,
        )  # fmt: skip
        assert manager.save(1, model, optimizer, {"step": 1}, rng_state()) is not None

        def failing_write(path: Path, state: object) -> None:
            if rank == 1:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            real_write(path, state)  # type: ignore[arg-type]

        manager_module.write_rng_file = failing_write  # type: ignore[assignment]
        try:
            outcome = manager.save(2, model, optimizer, {"step": 2}, rng_state())
            results.append(f"{policy}: returned {outcome}; {' | '.join(logged[-1:])}")
        except CheckpointSaveError as err:
            results.append(f"{policy}: raised {err}")
        finally:
            manager_module.write_rng_file = real_write
        # The earlier checkpoint is whole, and the failed one's folder gone, on every rank.
        results.append(f"step 1 damage: {damage(save_dir / 'checkpoint-00000001')}")
        torch.distributed.barrier()
        results.append(f"step 2 exists: {(save_dir / 'checkpoint-00000002').exists()}")
    return results


def test_a_write_failing_on_one_rank_is_settled_on_both(tmp_path: Path) -> None:
    per_rank = run_workers(_worker, 2, str(tmp_path))
    assert per_rank[0] == per_rank[1], per_rank
    lines = per_rank[0]
    step1 = tmp_path / "continue" / "checkpoint-00000001"
    rng1 = tmp_path / "continue" / "checkpoint-00000002" / "rng" / "rank_00001.pt"
    assert lines[0].startswith(
        f"continue: returned None; checkpoint: saving step 2 to {rng1.parents[1]} failed on rank 1: "
        f"Read-only file system ({rng1}) (200.0 MiB free there); "
    ), lines[0]
    assert lines[0].endswith(
        f"the last complete checkpoint is {step1}; training goes on (checkpoint.on_save_error: continue)"
    )
    assert lines[3].startswith("stop: raised checkpoint: saving step 2") and lines[3].endswith(
        "stopping (checkpoint.on_save_error: stop)"
    )
    assert lines[1] == lines[4] == "step 1 damage: None"
    assert lines[2] == lines[5] == "step 2 exists: False"
