"""The shared rank pool (`tests.distributed._pool`): results, failures, hangs and state reset.

The distributed tests trust the pool to fail them when a rank fails and to hand every task the
state of a fresh process; these checks would catch a pool that swallows a traceback, stays stuck
after a hang, or lets a dtype, a flag, a variable or a process group through to the next task.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import _pool
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow


def _identity(rank: int, world: int, value: int) -> tuple[int, int, int, int]:
    total = torch.tensor([rank])
    dist.all_reduce(total)
    return rank, world, value, int(total)


def _fail_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one says no")
    dist.barrier()  # rank 0 waits here for a peer that never comes


def _hang(rank: int, world: int) -> None:
    if rank == 0:
        time.sleep(60)


def _leave_state(rank: int, world: int) -> int:
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True)
    os.environ["MESHFORGE_POOL_LEFTOVER"] = "1"
    dist.new_group(list(range(world)))
    torch.manual_seed(123)
    return os.getpid()


def _see_state(rank: int, world: int) -> tuple[int, str, bool, str | None, int, float]:
    from torch.distributed.distributed_c10d import _world

    return (
        os.getpid(),
        str(torch.get_default_dtype()),
        torch.are_deterministic_algorithms_enabled(),
        os.environ.get("MESHFORGE_POOL_LEFTOVER"),
        len(_world.pg_map),
        float(torch.rand(1)),
    )


def _env(rank: int, world: int) -> tuple[str | None, str]:
    return os.environ.get("MESHFORGE_POOL_TEST"), os.getcwd()


def _many_groups(rank: int, world: int) -> int:
    for _ in range(_pool._MAX_GROUPS):
        dist.new_group(list(range(world)))
    return os.getpid()


def _destroy_default(rank: int, world: int) -> int:
    dist.destroy_process_group()
    return os.getpid()


def _unpicklable(rank: int, world: int) -> object:
    return lambda: rank


def _pid(rank: int, world: int) -> int:
    return os.getpid()


@pytest.mark.parametrize("world", [2, 4])
def test_results_in_rank_order(world: int) -> None:
    got = run_workers(_identity, world, 7)
    assert got == [(rank, world, 7, sum(range(world))) for rank in range(world)]


def test_failing_rank_fails_with_its_traceback_and_the_pool_restarts() -> None:
    before = run_workers(_pid, 2)
    with pytest.raises(AssertionError) as failure:
        run_workers(_fail_on_one, 2)
    message = str(failure.value)
    assert "rank 1:" in message and "ValueError: rank one says no" in message
    after = run_workers(_pid, 2)
    assert not set(before) & set(after), "a failed task's ranks were reused"


def test_a_result_that_cannot_be_sent_back_fails_the_test() -> None:
    with pytest.raises(AssertionError, match="rank 0:(.|\n)*pickle"):
        run_workers(_unpicklable, 2)


def test_hung_rank_times_out_and_the_pool_restarts() -> None:
    before = run_workers(_pid, 2)
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 0: no result after 3 s"):
        run_workers(_hang, 2, timeout=3)
    assert time.monotonic() - start < 30
    after = run_workers(_pid, 2)
    assert not set(before) & set(after), "a hung task's ranks were reused"


def test_state_a_task_leaves_is_put_back() -> None:
    fresh = run_workers(_see_state, 2, fresh=True)
    before = run_workers(_see_state, 2)
    pids = run_workers(_leave_state, 2)
    seen = run_workers(_see_state, 2)
    assert [s[0] for s in seen] == pids, "the pool was restarted instead of reset"
    # Same dtype, flags and variables as a fresh process; the task's group stays (module docstring).
    assert [s[1:4] for s in seen] == [s[1:4] for s in fresh]
    assert seen[0][1:4] == ("torch.float32", False, None)
    assert [s[4] for s in seen] == [s[4] + 1 for s in before]
    # The RNG is reseeded (from the OS, as in a new process), not left at the task's seed.
    after_123 = float(torch.rand(1, generator=torch.Generator().manual_seed(123)))
    assert all(s[5] != after_123 for s in seen)


def test_task_sees_the_tests_environment_and_folder(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHFORGE_POOL_TEST", "seen")
    monkeypatch.chdir(tmp_path)
    assert run_workers(_env, 2) == [("seen", str(tmp_path))] * 2


def test_too_many_groups_restart_the_pool() -> None:
    pids = run_workers(_many_groups, 2)
    assert not set(pids) & set(run_workers(_pid, 2))


def test_destroyed_default_group_restarts_the_pool() -> None:
    pids = run_workers(_destroy_default, 2)
    assert not set(pids) & set(run_workers(_pid, 2))
    assert _pool.pool(2).alive
