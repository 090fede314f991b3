"""The configs a user runs first train unchanged on 2 processes (only the step count is lowered).

They give the batch per process, so the global batch doubles with the second rank instead of
stopping at "global_batch_size is smaller than data-parallel size 2 x local_batch_size"; their
relative output and cache folders land in the working directory, as for a user.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import read_metrics, train_here
from tests.distributed._spawn import run_workers
from tests.unit.test_batch_scaling import FIRST_CONFIGS

REPO = Path(__file__).resolve().parents[2]


def _train_as_shipped(rank: int, world: int, configs: list[str]) -> list[str]:
    """A worker: each config trained for 2 steps; the batch lines rank 0 logged."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    lines: list[str] = []
    for config in configs:
        train_here(REPO / config, ["--training.steps=2"], log=lines.append)
    return [line for line in lines if "global batch" in line]


@pytest.mark.slow
def test_first_configs_train_unchanged_on_two_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    batch_lines = run_workers(_train_as_shipped, 2, FIRST_CONFIGS)[0]
    assert len(batch_lines) == len(FIRST_CONFIGS)
    assert all("global batch 32 = dp 2 x local 16 x accumulation 1" in line for line in batch_lines)
    for folder in ("demo", "pretrain_megatron_tiny", "llama-tiny"):
        assert read_metrics(tmp_path / "output" / folder)[-1]["step"] == 2, folder
