"""MESHFORGE_COMM_STATS=1 records each step's collectives: FSDP moves every parameter twice per step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import read_metrics
from tests.distributed._layouts import train_one

pytestmark = pytest.mark.slow


def test_fsdp_step_gathers_and_reduces_every_parameter(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHFORGE_COMM_STATS", "1")
    one, two = tmp_path / "one", tmp_path / "two"
    train_one(tiny_config, ["--training.steps=2", f"--training.output_dir={one}"], cwd=tmp_path)
    proc = train_one(
        tiny_config, ["--training.steps=2", f"--training.output_dir={two}"], nproc=2, cwd=tmp_path
    )
    millions = float(re.search(r"with ([0-9.]+)M parameters", proc.stdout).group(1))
    param_bytes = millions * 1e6 * 4
    single = read_metrics(one)
    # One process: only scalar bookkeeping, no parameter traffic.
    assert all(r["comm_bytes"] < 1024 for r in single)
    for record in read_metrics(two):
        # All-gather of every parameter in forward (and again in backward for resharded layers)
        # plus the reduce-scatter of every gradient: at least 2x, at most ~3x the parameter bytes.
        assert 1.9 * param_bytes <= record["comm_bytes"] <= 3.2 * param_bytes
        assert record["comm_calls"] > 0
