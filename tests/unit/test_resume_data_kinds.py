"""A run restarted from its own checkpoint continues exactly, for Megatron and SFT data too."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, read_metrics
from tests.distributed._layouts import train_one

CONFIGS = [
    REPO / "configs" / "qwen3" / "pretrain_megatron_tiny.yaml",
    REPO / "configs" / "qwen3" / "sft_chatml_tiny.yaml",
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
@pytest.mark.slow
def test_restart_from_checkpoint_continues_exactly(config: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    common = ["--training.steps=4", "--training.deterministic=true", "--checkpoint.save_interleaved_steps=2"]
    train_one(config, [*common, f"--training.output_dir={run}"], cwd=tmp_path)
    full = read_metrics(run)
    again = tmp_path / "again"
    step2 = run / "checkpoints" / "checkpoint-00000002"
    train_one(
        config, [*common, f"--training.output_dir={again}", f"--checkpoint.load_path={step2}"], cwd=tmp_path
    )
    resumed = read_metrics(again)
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]
