"""Evaluation in the loop (eval_interval, end of run) and training.epochs, through `meshforge train`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.conftest import REPO, meshforge_here, read_metrics
from tests.distributed._layouts import train_one

pytestmark = pytest.mark.slow  # whole trainings, in this process

SFT = REPO / "configs" / "qwen3" / "sft_alpaca_tiny.yaml"
MEGATRON = REPO / "configs" / "qwen3" / "pretrain_megatron_tiny.yaml"
SMALL = ["--training.log_interval=1", "--checkpoint.enable_save=false"]


def test_sft_validation_split_is_evaluated_without_changing_training(tmp_path: Path) -> None:
    common = [*SMALL, "--training.steps=4", "--train_dataset.val_size=0.1"]
    plain, evaluated = tmp_path / "plain", tmp_path / "eval"
    train_one(SFT, [*common, f"--training.output_dir={plain}"], cwd=tmp_path)
    proc = train_one(
        SFT, [*common, "--training.eval_interval=2", f"--training.output_dir={evaluated}"], cwd=tmp_path
    )
    a, b = read_metrics(plain), read_metrics(evaluated)
    assert [r["step"] for r in b if "eval_loss" in r] == [2, 4]
    assert all(math.isfinite(r["eval_loss"]) and r["eval_tokens"] > 0 for r in b if "eval_loss" in r)
    # Evaluating touches neither the data order, the RNG nor the weights the next step uses.
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert "eval step 2: eval_loss" in proc.stdout
    # Without eval_interval the validation split is still evaluated once, at the end.
    assert [r["step"] for r in a if "eval_loss" in r] == [4]


def test_megatron_validation_split_and_missing_validation_data(tmp_path: Path) -> None:
    out = tmp_path / "mg"
    overrides = [
        *SMALL,
        "--training.steps=2",
        "--training.eval_interval=1",
        "--training.eval_iters=2",
        "--train_dataset.dataloader.config.split=90,10,0",
        f"--train_dataset.dataloader.config.path_to_cache={tmp_path / 'cache'}",
        f"--training.output_dir={out}",
    ]
    train_one(MEGATRON, overrides, cwd=tmp_path)
    records = read_metrics(out)
    assert [r["step"] for r in records if "eval_loss" in r] == [1, 2]
    # eval_iters: 2 batches of 16 rows x 128 tokens per evaluation.
    assert all(0 < r["eval_tokens"] <= 2 * 16 * 128 for r in records)
    # The second evaluation follows one more update on the same validation data.
    assert records[1]["eval_loss"] != records[0]["eval_loss"]


def test_eval_interval_without_validation_data_is_an_error(tmp_path: Path) -> None:
    args = ["train", "--config", str(SFT), *SMALL, "--training.steps=1", "--training.eval_interval=1"]
    proc = meshforge_here(*args, cwd=tmp_path)
    assert proc.returncode != 0, "eval_interval without validation data must fail"
    assert "training.eval_interval: needs evaluation data" in proc.stdout + proc.stderr


def test_epochs_size_the_run_from_the_data(tmp_path: Path) -> None:
    out = tmp_path / "epochs"
    # 48 examples packed into 256-token rows: a few steps of 8 rows make one epoch.
    proc = train_one(
        SFT,
        [*SMALL, "--training.epochs=1", "--train_dataset.max_samples=48", f"--training.output_dir={out}"],
        cwd=tmp_path,
    )
    text = proc.stdout
    line = next(x for x in text.splitlines() if "training.epochs 1 x" in x)
    steps = int(line.split("=")[1].split("steps")[0].replace(",", "").strip())
    assert steps >= 1
    assert [r["step"] for r in read_metrics(out)] == list(range(1, steps + 1))
