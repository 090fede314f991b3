"""`Trainer`'s hooks stay overridable, and the batch plan comes from `TrainingConfig`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from meshforge.config import load_config
from meshforge.train.config import TrainingConfig
from meshforge.train.trainer import Trainer, plan_batches


class CountingTrainer(Trainer):
    """Overrides each hook the way a user's subclass would."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.micro_batches = 0
        self.records: list[dict[str, Any]] = []

    def forward_backward(self, batch: dict[str, torch.Tensor], normalizer: torch.Tensor) -> torch.Tensor:
        self.micro_batches += 1
        return super().forward_backward(batch, normalizer) * 0 + 1234.0

    def clip_grads(self) -> torch.Tensor:
        super().clip_grads()
        return torch.tensor(7.0)

    def log_step(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        super().log_step(record)


def test_a_subclass_overrides_forward_backward_clip_grads_and_log_step(tiny_config: Path) -> None:
    cfg = load_config(
        str(tiny_config),
        [
            "training.steps=2",
            f"training.output_dir={tiny_config.parent / 'hooks'}",
            "checkpoint.enable_save=false",
            "training.deterministic=false",
        ],
    )
    trainer = CountingTrainer(cfg, log=lambda _msg: None)
    trainer.setup()
    trainer.train()
    # global 4 = dp 1 x local 2 x accumulation 2: two micro-batches per step, each through the hook.
    assert trainer.run.env.plan.grad_accum_steps == 2
    assert trainer.micro_batches == 4
    assert [r["step"] for r in trainer.records] == [1, 2]
    # The step reports what the overridden hooks returned.
    normalizer = [r["valid_tokens"] for r in trainer.records]
    for record, tokens in zip(trainer.records, normalizer, strict=True):
        assert record["grad_norm"] == 7.0
        assert record["loss"] == pytest.approx(2 * 1234.0 / tokens, rel=1e-6)


def test_plan_batches_follows_training_accumulation_steps() -> None:
    plan, note = plan_batches(TrainingConfig(global_batch_size=10, local_batch_size=2), 2)
    assert (plan.grad_accum_steps, plan.global_batch_size) == (2, 8)
    assert note is not None and "training.global_batch_size 10" in note and "using 8" in note
    plan, note = plan_batches(TrainingConfig(global_batch_size=8, local_batch_size=2), 2)
    assert (plan.grad_accum_steps, note) == (2, None)
    plan, note = plan_batches(TrainingConfig(gradient_accumulation_steps=3, local_batch_size=2), 4)
    assert (plan.grad_accum_steps, plan.global_batch_size, note) == (3, 24, None)
    with pytest.raises(
        ValueError, match=r"training\.global_batch_size: 2 is smaller than data-parallel size 2"
    ):
        plan_batches(TrainingConfig(global_batch_size=2, local_batch_size=2), 2)
