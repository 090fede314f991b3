"""A bad step computed again: a transient fault continues as the uninterrupted run, a real divergence is skipped.

The runs use attention dropout, so the rerun equals the first computation only when every RNG
went back to its state at the start of the step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshforge.train.trainer import Trainer
from tests.conftest import DROPOUT, read_metrics, train_here


class FaultyTrainer(Trainer):
    """Makes this rank's loss of step 3 NaN: on its first computation only (`transient`) or on every one."""

    transient = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.poisoned = 0

    def forward_backward(self, batch: dict[str, torch.Tensor], normalizer: torch.Tensor) -> torch.Tensor:
        loss = super().forward_backward(batch, normalizer)
        if self.step + 1 == 3 and (not self.transient or self.poisoned < self.run.env.plan.grad_accum_steps):
            self.poisoned += 1
            return loss * float("nan")
        return loss


def _train(cls: type[Trainer], config: Path, out: Path, *overrides: str) -> list[str]:
    lines: list[str] = []
    overrides_all = ["--training.steps=4", f"--training.output_dir={out}", DROPOUT, *overrides]
    train_here(config, overrides_all, log=lines.append, trainer_cls=cls)
    return lines


@pytest.mark.slow  # whole trainings
def test_a_transient_fault_is_told_from_a_divergence(
    four_step_run: tuple[Path, Path, list[dict]], tmp_path: Path
) -> None:
    config, _, full = four_step_run
    lines = _train(FaultyTrainer, config, tmp_path / "transient")
    faults = [line for line in lines if "transient fault" in line]
    assert len(faults) == 1 and faults[0].startswith("step 3: transient fault: loss nan"), lines
    assert "(rank(s) 0); the rerun's result stands" in faults[0]
    records = read_metrics(tmp_path / "transient")
    assert [r["loss"] for r in records] == [r["loss"] for r in full]  # bitwise: dropout included
    assert records[2]["rerun"] == "transient" and not records[2].get("skipped")

    class Diverging(FaultyTrainer):
        transient = False

    lines = _train(Diverging, config, tmp_path / "diverged")
    assert any(line.startswith("step 3: the rerun reproduces loss nan") for line in lines), lines
    records = read_metrics(tmp_path / "diverged")
    assert records[2]["skipped"] and records[2]["rerun"] == "divergence"

    lines = _train(FaultyTrainer, config, tmp_path / "off", "--training.rerun_mode=disabled")
    assert not any("rerun" in line for line in lines)
    records = read_metrics(tmp_path / "off")
    assert records[2]["skipped"] and "rerun" not in records[2]
