"""`training.log_throughput`: model TFLOP/s in every step record and on the console line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from meshforge.config import load_config
from meshforge.monitor.metrics import format_step_line
from meshforge.monitor.throughput import model_flops_per_token, peak_flops, throughput_fields
from meshforge.train.trainer import Trainer


class RecordingTrainer(Trainer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[dict[str, Any]] = []

    def log_step(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        super().log_step(record)


def _run(tiny_config: Path, *overrides: str) -> tuple[RecordingTrainer, list[str]]:
    cfg = load_config(
        str(tiny_config),
        [
            "training.steps=2",
            f"training.output_dir={tiny_config.parent / 'out'}",
            "checkpoint.enable_save=false",
            *overrides,
        ],
    )
    logs: list[str] = []
    trainer = RecordingTrainer(cfg, log=logs.append)
    trainer.setup()
    trainer.train()
    return trainer, logs


def test_log_throughput_adds_model_flops_per_second(tiny_config: Path) -> None:
    trainer, _ = _run(tiny_config, "training.log_throughput=true")
    seq = trainer.cfg.train_dataset.seq_length()
    assert seq is not None
    expected_per_token = trainer.model.flops_per_token(seq)  # the built-in family's own count
    assert trainer.run.model.flops_per_token == pytest.approx(expected_per_token)
    for record in trainer.records:
        assert record["tflops"] == pytest.approx(expected_per_token * record["tokens_per_s"] / 1e12)
        assert record["tflops_per_rank"] == pytest.approx(record["tflops"])  # one process
        assert "mfu" not in record  # no known peak on the CPU
        assert "TFLOP/s/rank" in format_step_line(record, 2)


def test_without_log_throughput_the_record_has_no_flops(tiny_config: Path) -> None:
    trainer, _ = _run(tiny_config)
    assert trainer.run.model.flops_per_token is None
    assert all("tflops" not in r for r in trainer.records)
    assert "TFLOP/s" not in format_step_line(trainer.records[0], 2)


def test_no_op_keys_are_warned_at_train(tiny_config: Path) -> None:
    _, logs = _run(tiny_config, "parallelism.cpu_offload=true", "train_dataset.persistent_workers=true")
    text = "\n".join(logs)
    assert "warning: parallelism.cpu_offload: no effect on cpu" in text
    assert "warning: train_dataset.persistent_workers:" in text


def test_generic_count_and_mfu_arithmetic() -> None:
    model = torch.nn.Linear(4, 3)  # no flops_per_token: 6 x parameters
    assert model_flops_per_token(model, 128) == 6.0 * (4 * 3 + 3)
    fields = throughput_fields(1000.0, flops_per_token=1e9, world_size=4, peak=1e12)
    assert fields == {"tflops": 1.0, "tflops_per_rank": 0.25, "mfu": 0.25}
    assert peak_flops(torch.device("cpu"), torch.float32) is None
