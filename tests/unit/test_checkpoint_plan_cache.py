"""`checkpoint.save_global_layout_cache`: DCP's save-plan cache, keyed per manager.

With the cache the second save of a run reuses the first save's global plan and metadata; the
step it writes must still hold that step's weights (not the first step's), and a manager with the
cache off must leave DCP's cache untouched.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.planner import SavePlanner

from meshforge.checkpoint.manager import CheckpointManager
from meshforge.utils.seed import rng_state
from tests._compare import rel_error
from tests._process_group import one_rank  # noqa: F401 (a fixture)


def _manager(root: Path, *, cache: bool) -> CheckpointManager:
    return CheckpointManager(
        save_dir=root,
        prefix="ckpt",
        interval=1,
        keep=None,
        enabled=True,
        save_optimizer=True,
        rank=0,
        log=lambda _msg: None,
        cache_save_plan=cache,
    )


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 8)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("cache", [True, False])
def test_later_saves_hold_their_own_step(tmp_path: Path, cache: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    manager = _manager(tmp_path, cache=cache)
    _step(model, optimizer)
    manager.save(1, model, optimizer, {"step": 1}, rng_state())
    assert (manager._planner_key in SavePlanner._cached_global_plan) is cache
    for step in (2, 3):
        _step(model, optimizer)
        manager.save(step, model, optimizer, {"step": step}, rng_state())
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    fresh = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    _step(fresh, fresh_opt)  # the optimizer state must exist to be loaded into
    loaded = _manager(tmp_path, cache=cache).load(tmp_path, fresh, fresh_opt, load_optimizer=True)
    assert loaded.path.name == "ckpt-00000003"
    for name, tensor in fresh.state_dict().items():
        assert rel_error(tensor, expected[name]) == 0.0, name
    state = fresh_opt.state_dict()["state"]
    assert int(state[0]["step"]) == 3
