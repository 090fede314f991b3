"""Pipeline parallelism in the trainer: evaluation through the schedule, and the dx/dw split."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, read_metrics, run_train

pytestmark = pytest.mark.slow

SFT = REPO / "configs" / "qwen3" / "sft_alpaca_tiny.yaml"
COMMON = [
    "--training.steps=2",
    "--training.log_interval=1",
    "--training.eval_interval=1",
    "--training.eval_iters=3",
    "--train_dataset.val_size=24",
    "--train_dataset.max_samples=120",
    "--checkpoint.enable_save=false",
]


def test_pp2_evaluates_and_zero_bubble_equals_one_process(tmp_path: Path) -> None:
    one, pp, zb = tmp_path / "one", tmp_path / "pp", tmp_path / "zb"
    run_train(SFT, [*COMMON, f"--training.output_dir={one}"], cwd=tmp_path)
    run_train(
        SFT,
        [*COMMON, "--parallelism.pipeline_parallel=2", f"--training.output_dir={pp}"],
        nproc=2,
        cwd=tmp_path,
    )
    run_train(
        SFT,
        [
            *COMMON,
            "--parallelism.pipeline_parallel=2",
            "--parallelism.pipeline_parallel_schedule=interleaved",
            "--parallelism.pipeline_parallel_interleave_num=2",
            "--parallelism.pipeline_parallel_enable_dxdw_split=true",
            f"--training.output_dir={zb}",
        ],
        nproc=2,
        cwd=tmp_path,
    )
    ref = read_metrics(one)
    assert [r["step"] for r in ref if "eval_loss" in r] == [1, 2]
    for run in (pp, zb):
        got = read_metrics(run)
        for x, y in zip(ref, got, strict=True):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)
            assert y["eval_loss"] == pytest.approx(x["eval_loss"], rel=1e-5)
            assert y["eval_tokens"] == x["eval_tokens"]
