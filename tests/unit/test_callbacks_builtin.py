"""The built-in callbacks of the loop: the checkpoint saver's decisions, and the order of a step
(the profiler window brackets the whole step, its save included)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from meshforge.train.saver import CheckpointSaver
from tests._process_group import leave_no_process_group  # noqa: F401 (a fixture)


class _Manager:
    """A checkpoint manager's decisions (`should_save` as the real one) and a recording `save`."""

    def __init__(self, *, enabled: bool, interval: int | None) -> None:
        self.enabled, self.interval = enabled, interval
        self.async_save = False
        self.last_saved_step: int | None = None
        self.saved: list[int] = []

    def should_save(self, step: int, last_step: int) -> bool:
        if not self.enabled or step == self.last_saved_step:
            return False
        return (self.interval is not None and step % self.interval == 0) or step == last_step

    def save(self, step: int, model: Any, optimizer: Any, state: dict[str, Any], rng: Any) -> Path:
        self.saved.append(step)
        self.last_saved_step = step
        return Path(f"checkpoint-{step}")


def _saver(
    manager: _Manager, preempted: list[bool], notified: list[Path], step: list[int]
) -> CheckpointSaver:
    return CheckpointSaver(
        manager,  # type: ignore[arg-type]
        model=None,  # type: ignore[arg-type]
        optimizer=None,  # type: ignore[arg-type]
        trainer_state=lambda: {"step": step[0]},
        preempted=lambda: preempted[0],
        total_steps=10,
        log=lambda _msg: None,
        on_save=notified.append,
    )


def test_the_saver_saves_on_interval_last_preempted_and_requested_steps_once_each() -> None:
    manager = _Manager(enabled=True, interval=4)
    preempted, notified, step = [False], [], [0]
    saver = _saver(manager, preempted, notified, step)
    for n in range(1, 11):
        step[0] = n
        saver.on_step_end({"step": n})
        saver.on_step_close(n, save=n in (3, 4), stop=False)  # 4: asked for, and saved already
    assert manager.saved == [3, 4, 8, 10]
    assert notified == [Path(f"checkpoint-{n}") for n in (3, 4, 8, 10)]
    assert saver.last_path == Path("checkpoint-10")


def test_a_stop_saves_only_with_saving_on_and_a_preempted_step_saves_anyway() -> None:
    for enabled, expected in ((True, [2, 5]), (False, [5])):
        manager = _Manager(enabled=enabled, interval=None)
        preempted, notified, step = [False], [], [0]
        saver = _saver(manager, preempted, notified, step)
        step[0] = 2
        saver.on_step_end({"step": 2})
        saver.on_step_close(2, save=False, stop=True)  # a callback's stop: a last step's checkpoint
        step[0] = 5
        preempted[0] = True
        saver.on_step_end({"step": 5})  # checkpoint.enable_save or not: the way back
        saver.on_step_close(5, save=True, stop=False)  # saved at this step already
        assert manager.saved == expected


@pytest.mark.slow
@pytest.mark.usefixtures("leave_no_process_group")
def test_the_profiler_window_brackets_each_step_and_its_save(
    tiny_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshforge.checkpoint.manager import CheckpointManager
    from meshforge.config import load_config
    from meshforge.monitor.profiling import StepProfiler
    from meshforge.train.trainer import Trainer

    events: list[tuple[str, int]] = []

    def recorded(cls: type, name: str, label: str) -> None:
        original = getattr(cls, name)

        def wrapper(self: Any, step: int, *args: Any, **kwargs: Any) -> Any:
            events.append((label, step))
            return original(self, step, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    recorded(StepProfiler, "step_begin", "begin")
    recorded(StepProfiler, "step_end", "end")
    recorded(CheckpointManager, "save", "save")
    out = tiny_config.parent / "bracketed"
    overrides = [
        "training.steps=2",
        f"training.output_dir={out}",
        "profiler.enable_profiling=true",
        "profiler.start_step=2",
        "profiler.end_step=2",
    ]
    lines: list[str] = []
    trainer = Trainer(load_config(str(tiny_config), overrides), log=lines.append)
    trainer.setup()
    # with_stack is on (the default) and the run's first save falls inside the window: torch
    # cannot always read the window's event names back then; the run must still finish.
    summary = trainer.train()
    assert events == [
        ("begin", 1),
        ("end", 1),
        ("begin", 2),
        ("save", 2),
        ("end", 2),
    ]
    assert summary.last_checkpoint is not None and summary.last_checkpoint.name.endswith("00000002")
    trace = out / "profile" / "rank0_step2-2.pt.trace.json.gz"
    assert trace.is_file()
    (line,) = [line for line in lines if line.startswith("profiler: steps 2-2 on rank 0 -> ")]
    assert "top operators by self time: aten::" in line or "no top operators: " in line
