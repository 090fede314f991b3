"""A run that goes wrong through the user's settings ends with one line, never a traceback.

`checkpoint.save_max: null` (documented as "keep all") and an exploding learning rate, both
through `meshforge train` as a user types them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._process_group import leave_no_process_group  # noqa: F401 (a fixture)
from tests.conftest import read_metrics, train_cli

pytestmark = pytest.mark.slow

# An exploding run on the tiny model: the gradient norm turns NaN within a few steps.
EXPLODE = ["--lr_scheduler.learning_rate=1e6", "--training.max_norm=1e30", "--lr_scheduler.warmup_steps=0"]


def test_save_max_null_keeps_every_checkpoint(tiny_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train_cli(
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


@pytest.mark.procs
def test_exploding_run_skips_then_stops_with_one_line_and_the_last_good_state(
    tiny_config: Path, tmp_path: Path
) -> None:
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
            "--monitor.health_checkpoint.global_norm_skip_time=3",
            "--monitor.health_checkpoint.global_norm_skip_threshold=1e12",
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
    assert message.startswith("error: monitor.health_checkpoint: 3 consecutive steps skipped"), message
    assert "gradient norms [" in message
    records = read_metrics(out)
    assert len(records) < 12
    # Every logged loss and norm is finite or null, and only skipped steps hold a null.
    for r in records:
        for key in ("loss", "grad_norm"):
            assert r[key] is None or math.isfinite(r[key]), r
            if r[key] is None:
                assert r["skipped"] is True, r
    skipped = [r["step"] for r in records if r.get("skipped")]
    last = records[-1]["step"]
    assert skipped[-3:] == [last - 2, last - 1, last]
    applied = [r["step"] for r in records if not r.get("skipped")]
    assert f"weights after step {last - 3}" in message
    # The stop saved a complete checkpoint at the step it stopped, holding the last applied update.
    saved = out / "checkpoints" / f"checkpoint-{last:08d}"
    assert (saved / "COMPLETE").is_file()
    assert str(saved) in message
    state = json.loads((saved / "trainer_state.json").read_text())
    assert state["step"] == last
    # The schedule stepped once per applied update (ConstantWarmUpLR counts its own steps).
    assert state["scheduler"]["last_epoch"] == len(applied)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.usefixtures("leave_no_process_group")
def test_a_non_finite_step_is_not_applied(tiny_config: Path) -> None:
    from meshforge.config import load_config
    from meshforge.train.trainer import HealthStopError, Trainer, TrainingDivergedError

    overrides = [
        "training.steps=12",
        f"training.output_dir={tiny_config.parent / 'inproc'}",
        "checkpoint.enable_save=false",
        "training.deterministic=false",
        *(o.removeprefix("--") for o in EXPLODE),
    ]
    trainer = Trainer(load_config(str(tiny_config), overrides), log=lambda _msg: None)
    trainer.setup()
    applied: list[int] = []
    original = trainer.run.optim.optimizer.step

    def counting_step(*args: object, **kwargs: object) -> object:
        applied.append(trainer.step + 1)
        return original(*args, **kwargs)

    trainer.run.optim.optimizer.step = counting_step  # type: ignore[method-assign]
    with pytest.raises(HealthStopError, match=r"^monitor\.health_checkpoint: 10 consecutive steps skipped"):
        trainer.train()
    assert issubclass(HealthStopError, TrainingDivergedError)
    assert 10 <= trainer.step <= 12
    records = read_metrics(tiny_config.parent / "inproc")
    skipped = [r["step"] for r in records if r.get("skipped")]
    assert len(skipped) >= 10
    assert sorted(applied + skipped) == list(range(1, trainer.step + 1))
    # The optimizer applied exactly the steps that were not skipped, and the weights are finite.
    counts = {int(state["step"]) for state in trainer.run.optim.optimizer.state.values()}
    assert counts == {len(applied)}
    for name, param in trainer.model.named_parameters():
        assert torch.isfinite(param).all(), name


@pytest.mark.usefixtures("leave_no_process_group")
def test_a_threshold_skip_leaves_the_weights_and_warns_about_the_embedding(tiny_config: Path) -> None:
    from meshforge.config import load_config
    from meshforge.train.trainer import HealthStopError, Trainer

    overrides = [
        "training.steps=6",
        f"training.output_dir={tiny_config.parent / 'threshold'}",
        "checkpoint.enable_save=false",
        "monitor.health_checkpoint.global_norm_skip_threshold=1e-6",
        "monitor.health_checkpoint.global_norm_skip_time=4",
        "monitor.health_checkpoint.embedding_local_norm_threshold=0",
    ]
    lines: list[str] = []
    trainer = Trainer(load_config(str(tiny_config), overrides), log=lines.append)
    trainer.setup()
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with pytest.raises(HealthStopError, match=r"global_norm_skip_threshold 1e-06"):
        trainer.train()
    assert trainer.step == 4
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert trainer.run.optim.scheduler.last_epoch == 0
    records = read_metrics(tiny_config.parent / "threshold")
    assert [(r["step"], r["skipped"]) for r in records] == [(s, True) for s in range(1, 5)]
    assert all(r["skip_reason"].startswith("gradient norm ") for r in records)
    warnings = [line for line in lines if "embedding local gradient norm" in line]
    assert [w.split(": ")[:2] for w in warnings] == [["warning", f"step {s}"] for s in range(1, 5)]
    saved = tiny_config.parent / "threshold" / "checkpoints" / "checkpoint-00000004"
    assert (saved / "COMPLETE").is_file()
