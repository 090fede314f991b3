"""DPO on 2 data-parallel ranks (FSDP over both) equals one process: LoRA and full fine-tuning.

Full fine-tuning shards the frozen reference copy over the same mesh as the policy; LoRA's
reference is the policy with its adapters off. The loss, the gradient norm and every preference
metric of each step must equal the one-process run's (the pairs split over ranks, the metrics
reduced over the `loss` mesh).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_metrics
from tests.distributed._layouts import Run, train_all
from tests.unit.test_dpo_train import CONFIG, FULL, TINY

pytestmark = pytest.mark.slow

METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def test_dp2_equals_one_process_lora_and_full(tmp_path: Path) -> None:
    base = [*TINY, "--train_dataset.max_samples=16", "--training.steps=3"]
    tunings = {"lora": ["--lr_scheduler.learning_rate=2e-2"], "full": FULL}
    runs = [
        Run(CONFIG, [*base, *extra, f"--training.output_dir={tmp_path / name / str(nproc)}"], nproc)
        for nproc in (1, 2)
        for name, extra in tunings.items()
    ]
    train_all(runs)
    for name in tunings:
        one, two = read_metrics(tmp_path / name / "1"), read_metrics(tmp_path / name / "2")
        assert len(one) == len(two) == 3
        assert len({r["loss"] for r in one}) == 3, one  # it trains
        for a, b in zip(one, two, strict=True):
            assert b["pairs"] == a["pairs"] == 8
            for key in METRICS:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (name, a["step"], key)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (name, a["step"])
