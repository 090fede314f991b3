"""A run that goes wrong through the user's settings ends with one line, never a traceback.

`checkpoint.save_max: null` (documented as "keep all") and an exploding learning rate, both
through `meshforge train` as a user types them.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import read_metrics, run_train

pytestmark = pytest.mark.slow

# An exploding run on the tiny model: the gradient norm turns NaN within a few steps.
EXPLODE = ["--lr_scheduler.learning_rate=1e6", "--training.max_norm=1e30", "--lr_scheduler.warmup_steps=0"]


def test_save_max_null_keeps_every_checkpoint(tiny_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_train(
        tiny_config,
        [
            "--training.steps=5",
            f"--training.output_dir={out}",
            "--checkpoint.save_interleaved_steps=1",
            "--checkpoint.save_max=null",
        ],
        cwd=tmp_path,
    )
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == [f"checkpoint-{step:08d}" for step in range(1, 6)]
    assert all((out / "checkpoints" / name / "COMPLETE").is_file() for name in saved)


def test_exploding_run_stops_with_one_line_and_a_nonzero_exit(tiny_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshforge",
            "train",
            "--config",
            str(tiny_config),
            "--training.steps=12",
            f"--training.output_dir={out}",
            "--checkpoint.save_interleaved_steps=1",
            "--checkpoint.save_max=null",
            *EXPLODE,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    message = errors[0]
    assert "not finite" in message
    assert "lr_scheduler.learning_rate" in message and "training.max_norm" in message
    records = read_metrics(out)
    stopped_at = len(records) + 1
    assert 1 < stopped_at <= 12
    assert f"error: step {stopped_at}:" in message
    # Every logged step was finite, and no checkpoint holds the step that stopped the run.
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved[-1] == f"checkpoint-{stopped_at - 1:08d}"


def test_a_non_finite_step_is_not_applied(tiny_config: Path) -> None:
    from meshforge.config import load_config
    from meshforge.trainer import Trainer, TrainingDivergedError

    overrides = [
        "training.steps=12",
        f"training.output_dir={tiny_config.parent / 'inproc'}",
        "checkpoint.enable_save=false",
        "training.deterministic=false",
        *(o.removeprefix("--") for o in EXPLODE),
    ]
    trainer = Trainer(load_config(str(tiny_config), overrides), log=lambda _msg: None)
    trainer.setup()
    with pytest.raises(TrainingDivergedError, match=r"^step \d+: the (loss|gradient norm) is not finite"):
        trainer.train()
    assert trainer.step >= 1
    # The optimizer applied exactly the completed steps, and the weights they left are finite.
    counts = {int(state["step"]) for state in trainer.optimizer.state.values()}
    assert counts == {trainer.step}
    for name, param in trainer.model.named_parameters():
        assert torch.isfinite(param).all(), name
