"""`checkpoint.async_save`: the copy runs off the loop, the update waits for it, saves never overlap.

The copy into host memory is held back on purpose (a patched stager) so that each test sees the
window in which the loop has moved on while the copy has not finished.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from meshforge.checkpoint.manager import CheckpointManager, is_complete, list_complete_steps
from meshforge.utils.seed import rng_state
from tests._process_group import leave_no_process_group, one_rank  # noqa: F401 (fixtures)
from tests.conftest import read_metrics


def _manager(root: Path) -> CheckpointManager:
    return CheckpointManager(
        save_dir=root,
        prefix="ckpt",
        interval=1,
        keep=None,
        enabled=True,
        save_optimizer=True,
        rank=0,
        async_save=True,
        log=lambda _msg: None,
    )


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _update(model, optimizer)
    return model, optimizer


def _update(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 8)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _hold(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> tuple[threading.Event, list[int]]:
    """Make `cls.name` wait for the returned event; the list collects the threads it ran on."""
    release, threads = threading.Event(), []
    original = getattr(cls, name)

    def held(self: object, *args: object, **kwargs: object) -> object:
        threads.append(threading.get_ident())
        assert release.wait(timeout=60), "the test never released the hold"
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, held)
    return release, threads


def _wait_for(condition: list[int]) -> None:
    deadline = time.monotonic() + 30
    while not condition and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition, "the background work never started"


@pytest.mark.usefixtures("one_rank")
def test_the_copy_runs_in_the_background_and_the_update_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = _trained()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_moment = optimizer.state[model[0].weight]["exp_avg"].clone()
    release, threads = _hold(monkeypatch, StateDictStager, "stage")
    manager = _manager(tmp_path)
    try:
        target = manager.save(1, model, optimizer, {"step": 1}, rng_state())
        _wait_for(threads)
        # save() came back while the copy is held on another thread.
        assert threads[0] != threading.get_ident()
        waiter = threading.Thread(target=manager.wait_staging)
        waiter.start()
        waiter.join(timeout=0.3)
        assert waiter.is_alive(), "wait_staging() returned before the copy finished"
        release.set()
        waiter.join(timeout=30)
        assert not waiter.is_alive()
        # The update after the wait changes the live weights, not the copy being written.
        _update(model, optimizer)
        manager.finalize()
    finally:
        release.set()
        manager.finalize()
        manager.close()
    assert is_complete(target)

    fresh, fresh_optimizer = _trained()
    _update(fresh, fresh_optimizer)
    _manager(tmp_path).load(target, fresh, fresh_optimizer, load_optimizer=True)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    assert torch.equal(fresh_optimizer.state[fresh[0].weight]["exp_avg"], saved_moment)


@pytest.mark.usefixtures("one_rank")
def test_a_save_waits_for_the_one_still_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = _trained()
    release, writers = _hold(monkeypatch, FileSystemWriter, "write_data")
    manager = _manager(tmp_path)
    try:
        first = manager.save(1, model, optimizer, {"step": 1}, rng_state())
        _wait_for(writers)
        manager.wait_staging()
        _update(model, optimizer)
        second = threading.Thread(target=manager.save, args=(2, model, optimizer, {"step": 2}, rng_state()))
        second.start()
        second.join(timeout=0.3)
        assert second.is_alive(), "the second save started while the first was still writing"
        assert not is_complete(first)
        release.set()
        second.join(timeout=60)
        assert not second.is_alive()
        assert is_complete(first)
        manager.finalize()
    finally:
        release.set()
        manager.finalize()
        manager.close()
    assert [step for step, _ in list_complete_steps(tmp_path)] == [1, 2]


@pytest.mark.slow
@pytest.mark.usefixtures("leave_no_process_group")
def test_a_run_resumes_bitwise_from_a_step_saved_in_the_background(
    tiny_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy of step 2 is slowed down: the step-3 update must not land in step 2's checkpoint."""
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    original = StateDictStager.stage

    def slow_stage(self: StateDictStager, *args: object, **kwargs: object) -> object:
        time.sleep(0.5)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StateDictStager, "stage", slow_stage)
    root = tiny_config.parent
    lines: list[str] = []

    def run(name: str, *overrides: str) -> Path:
        out = root / name
        cfg = load_config(
            str(tiny_config),
            [
                f"training.output_dir={out}",
                "checkpoint.async_save=true",
                "model.attention_dropout=0.2",
                *overrides,
            ],
        )
        trainer = Trainer(cfg, log=lines.append)
        trainer.setup()
        trainer.train()
        return out

    full = run("full")
    # The last save was still in flight when the loop ended: the run waited for it.
    assert "checkpoint: background save of step 4 finished" in "\n".join(lines)
    assert [step for step, _ in list_complete_steps(full / "checkpoints")] == [2, 4]
    resumed = run("resumed", f"checkpoint.load_path={full / 'checkpoints' / 'checkpoint-00000002'}")
    expected, got = read_metrics(full)[2:], read_metrics(resumed)
    assert [r["step"] for r in got] == [3, 4]
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in got] == [r[key] for r in expected], key
