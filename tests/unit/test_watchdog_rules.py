"""The step watchdog's limit, and what one hung process writes (one process; the exit is captured)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from meshforge.train.watchdog import HANG_EXIT_CODE, StepWatchdog


def _dog(tmp_path: Path, timeout: float | None, exits: list[int], lines: list[str]) -> StepWatchdog:
    return StepWatchdog(
        timeout, output_dir=tmp_path, rank=0, world_size=1, log=lines.append, exit=exits.append
    )


def test_the_limit_follows_the_median_step(tmp_path: Path) -> None:
    dog = _dog(tmp_path, None, [], [])
    assert dog.timeout() == 1200  # before 3 steps are measured (compilation, data preparation)
    dog.step_times.extend([0.5, 0.4, 100.0])
    assert dog.timeout() == 600  # 20 x the median is below the 10-min floor
    dog.step_times.extend([60.0, 61.0, 62.0])
    assert dog.timeout() == pytest.approx(20 * 60.5)
    dog.step_times.extend([200.0] * 10)
    assert dog.timeout() == 1500  # capped below the process group's 30-min timeout
    assert _dog(tmp_path, 7.5, [], []).timeout() == 7.5
    off = _dog(tmp_path, 0, [], [])
    off.start()
    assert not off.enabled and off._thread is None


def test_a_step_that_never_returns_is_reported_once(tmp_path: Path) -> None:
    exits: list[int] = []
    lines: list[str] = []
    dog = _dog(tmp_path, 0.2, exits, lines)
    dog.start()
    try:
        with dog.step(1):
            time.sleep(0.05)  # a normal step: nothing happens
        with dog.step(2):
            deadline = time.monotonic() + 10
            while not exits and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        dog.close()
    assert exits == [HANG_EXIT_CODE]
    assert len(lines) == 1 and lines[0].startswith("hang: step 2 ran 0 s, over training.step_timeout_s 0.2 s")
    report = (tmp_path / "hang-rank0.txt").read_text()
    assert report.startswith("rank 0 of 1: step 2 running for ")
    assert "test_a_step_that_never_returns_is_reported_once" in report  # this thread's stack
    assert len(dog.step_times) == 2
