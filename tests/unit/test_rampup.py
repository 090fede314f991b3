"""`training.rampup_batch_size` (Megatron's batch-size ramp-up): the sizes step by step, the
errors, and the trainer's accumulation, sample count, data order, schedule and resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from meshforge.config import ConfigError, config_from_dict
from meshforge.data.rampup import BatchRampUp

BASE = {
    "model": {"model_type": "qwen3"},
    "train_dataset": {"dataloader": {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": 8}},
}


def _megatron_batch(consumed: int, start: int, inc: int, samples: int, gbs: int) -> int:
    """Megatron's `RampupBatchsizeNumMicroBatchesCalculator.update`, written out with floats."""
    if consumed > samples:
        return gbs
    per_increment = samples / ((gbs - start) // inc)
    return start + int(consumed / per_increment) * inc


def test_sizes_follow_megatron_step_by_step() -> None:
    ramp = BatchRampUp(start=4, increment=4, ramp_samples=100, global_batch_size=16, micro_samples=4)
    assert ramp.sizes() == [4, 8, 12, 16]
    consumed, by_hand = 0, []
    for step in range(1, 16):
        want = _megatron_batch(consumed, 4, 4, 100, 16)
        assert ramp.batch_at(step) == want, step
        by_hand.append(want)
        consumed += want
        assert ramp.consumed_after(step) == consumed
        assert ramp.accumulation_at(step) == want // 4
    # 0..33 samples -> 4, 34..66 -> 8, 67..100 -> 12, then 16.
    assert by_hand[:14] == [4] * 9 + [8] * 4 + [12]
    assert ramp.ramp_steps() == 16 and ramp.batch_at(17) == 16
    assert ramp.schedule_position(3) == 12 / 16
    assert "4 -> 16 in steps of 4 over 100 samples (16 optimizer steps" in ramp.describe()


def test_no_ramp_cases() -> None:
    # Zero ramp samples, or a start at the global batch: the full batch from the first step.
    assert BatchRampUp(2, 2, 0, 8, 2).batch_at(1) == 8
    flat = BatchRampUp(8, 2, 1000, 8, 2)
    assert flat.sizes() == [8] and flat.batch_at(1) == 8 and flat.ramp_steps() == 0


def test_a_size_that_does_not_divide_is_an_error() -> None:
    with pytest.raises(
        ValueError, match=r"training\.rampup_batch_size: the global batch 6 of the ramp \[4, 6, 8\]"
    ):
        BatchRampUp(4, 2, 100, 8, 4)


@pytest.mark.parametrize(
    ("training", "fragment"),
    [
        ({"rampup_batch_size": [3, 2, 10], "global_batch_size": 8}, "is not a multiple of the increment 2"),
        ({"rampup_batch_size": [16, 2, 10], "global_batch_size": 8}, "the start batch 16 is larger"),
        (
            {"rampup_batch_size": [2, 2, 10], "gradient_accumulation_steps": 2},
            "not training.gradient_accumulation_steps",
        ),
    ],
)
def test_config_errors_name_the_key(training: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({**BASE, "training": training})
    assert "training.rampup_batch_size" in str(err.value) and fragment in str(err.value)


def _run(config: Path, out: Path, *extra: str, steps: int = 5) -> tuple[list[dict[str, Any]], list[Any], Any]:
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    seen: list[Any] = []

    class Recording(Trainer):
        def forward_backward(self, batch, normalizer):  # type: ignore[no-untyped-def]
            seen.append(batch["input_ids"].clone())
            return super().forward_backward(batch, normalizer)

    cfg = load_config(str(config), [f"training.steps={steps}", f"training.output_dir={out}", *extra])
    trainer = Recording(cfg, log=lambda _m: None)
    trainer.setup()
    trainer.train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, seen, trainer


RAMP = ["training.rampup_batch_size=[2, 2, 8]", "training.global_batch_size=8", "training.local_batch_size=2"]


@pytest.mark.slow
def test_trainer_ramp_counts_samples_and_resumes_bitwise(tiny_config: Path, tmp_path: Path) -> None:
    import torch

    full, seen, trainer = _run(tiny_config, tmp_path / "full", *RAMP)
    # [2, 2, 8] to 8 with 2-row micro-batches: 0 -> 2, 2 -> 2, 4 -> 4, 8 -> 8 (8 is not > 8).
    assert [r["global_batch_size"] for r in full] == [2, 2, 4, 8, 8]
    assert [r["consumed_samples"] for r in full] == [2, 4, 8, 16, 24]
    assert [r["tokens"] for r in full] == [b * 32 for b in (2, 2, 4, 8, 8)]
    assert len(seen) == 12  # micro-batches: 1 + 1 + 2 + 4 + 4
    # The schedule (ConstantWarmUpLR, 2 warm-up steps of the full batch) reads samples / 8.
    lr = 3e-3
    assert [r["lr"] for r in full] == pytest.approx([0.0, lr * 0.125, lr * 0.25, lr * 0.5, lr])
    # Data order: exactly the micro-batch stream of a fresh loader, nothing skipped or repeated
    # while the accumulation changes.
    from meshforge.train.build import build_train_data

    run = trainer.run
    stream = iter(
        build_train_data(trainer.cfg.train_dataset, trainer.cfg.training, run.env, run.model.tokenizer)[0]
    )
    assert all(torch.equal(a, next(stream)["input_ids"]) for a in seen)
    # Resume from the step-2 checkpoint, in the middle of the ramp: bitwise the same steps 3-5.
    step2 = tmp_path / "full" / "checkpoints" / "checkpoint-00000002"
    resumed, _, _ = _run(tiny_config, tmp_path / "resumed", *RAMP, f"checkpoint.load_path={step2}")
    assert [r["step"] for r in resumed] == [3, 4, 5]
    for a, b in zip(full[2:], resumed, strict=True):
        assert (a["loss"], a["lr"], a["grad_norm"], a["global_batch_size"]) == (
            b["loss"],
            b["lr"],
            b["grad_norm"],
            b["global_batch_size"],
        )
