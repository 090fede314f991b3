"""Two processes stop together at a non-finite step: one error line, both ranks exit 1, no hang."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import read_metrics

pytestmark = pytest.mark.slow


def test_two_ranks_stop_at_the_same_step_with_one_message(tiny_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "meshforge",
            "train",
            "--config",
            str(tiny_config),
            "--training.steps=12",
            f"--training.output_dir={out}",
            "--lr_scheduler.learning_rate=1e6",
            "--training.max_norm=1e30",
            "--lr_scheduler.warmup_steps=0",
        ],
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: step")]
    assert len(errors) == 1, proc.stderr  # rank 0 reports; rank 1 stops silently
    # Both workers ended with the trainer's exit status, not with a Python exception of ours
    # (torchrun prints its own summary of failed workers).
    assert proc.stderr.count("exitcode  : 1 ") == 2, proc.stderr
    assert "meshforge/trainer" not in proc.stderr
    records = read_metrics(out)
    assert errors[0].startswith(f"error: step {len(records) + 1}: ")
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
