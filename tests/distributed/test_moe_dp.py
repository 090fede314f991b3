"""Qwen3-MoE with its router loss: 2-process FSDP equals one process with accumulation.

Whole trainer runs in-process (`train_all`: the 2-rank run in the shared rank pool).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, read_metrics
from tests.distributed._layouts import Run, train_all

pytestmark = pytest.mark.slow


def test_moe_two_ranks_equal_one(tmp_path: Path) -> None:
    config = REPO / "configs" / "qwen3_moe" / "tiny.yaml"
    common = [
        "--training.steps=3",
        "--training.deterministic=true",
        "--model.num_hidden_layers=2",
        "--checkpoint.enable_save=false",
    ]
    train_all(
        [
            Run(config, [*common, f"--training.output_dir={tmp_path / 'one'}"]),
            Run(config, [*common, f"--training.output_dir={tmp_path / 'two'}"], nproc=2),
        ]
    )
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
