"""configs/qwen3/pretrain_megatron_tiny.yaml trains a few steps on the bundled Megatron sample."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.conftest import read_metrics
from tests.distributed._layouts import train_one

pytestmark = pytest.mark.slow  # every test here runs meshforge in a subprocess

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "qwen3" / "pretrain_megatron_tiny.yaml"


def test_tiny_megatron_config_trains(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = train_one(
        CONFIG,
        ["--training.steps=3", f"--training.output_dir={out}"],
        cwd=tmp_path,
    )
    assert "Megatron data:" in proc.stdout and "eod id 0" in proc.stdout
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[0]["loss"] > 8.0  # about ln(8192) = 9.0 at initialisation: real tokens, not padding
    # the index cache goes where the config says (relative to the working directory), not into assets/
    assert any(
        (tmp_path / "output" / "pretrain_megatron_tiny" / "data_cache").glob("*-GPTDataset-train-*.npy")
    )
