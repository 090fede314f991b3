"""A run that finishes with skipped steps says so in its closing line (and still exits 0).

The README's resume and run-health sections say the same: a non-finite step is skipped, the run
stops (exit 1) only after `global_norm_skip_time` consecutive skips, and otherwise ends with a
count of its skipped steps and their reasons.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshforge.train.run import TrainSummary
from tests.conftest import REPO, meshforge_here

DIVERGING = [
    "--lr_scheduler.learning_rate=1e3",
    "--lr_scheduler.warmup_steps=0",
    "--training.steps=10",
    "--model.num_hidden_layers=1",
    "--checkpoint.enable_save=false",
    "--monitor.plot_curves=false",
]


@pytest.mark.slow
def test_a_run_with_skipped_steps_counts_them_in_its_closing_line(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = meshforge_here(
        "train",
        "-c",
        str(REPO / "configs" / "demo.yaml"),
        *DIVERGING,
        f"--training.output_dir={out}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in records if r.get("skipped")]
    assert skipped, "the learning rate no longer makes steps non-finite: raise it"
    done = next(line for line in proc.stdout.splitlines() if line.startswith("Done:"))
    assert f"Warning: {len(skipped)} of 10 steps skipped ({len(skipped)} non-finite)" in done


def test_the_note_lists_each_reason_and_is_empty_without_skips(tmp_path: Path) -> None:
    plain = TrainSummary(steps=4, final_loss=1.0, tokens_per_s=1.0, output_dir=tmp_path, last_checkpoint=None)
    assert plain.health_note() == ""
    mixed = TrainSummary(
        steps=8,
        final_loss=1.0,
        tokens_per_s=1.0,
        output_dir=tmp_path,
        last_checkpoint=None,
        skipped={"non-finite": 2, "gradient norm above threshold": 1},
    )
    assert "3 of 8 steps skipped (1 gradient norm above threshold, 2 non-finite)" in mixed.health_note()


def test_readme_says_a_finished_run_with_skips_exits_zero() -> None:
    text = " ".join((REPO / "README.md").read_text().split())
    assert "A run that finishes with skipped steps exits 0" in text
    assert "stops before that step's update" not in text
