"""An exploding run on two processes (dp2, pp2): every rank skips the same steps, then all stop together.

One error line naming `monitor.health_checkpoint`, both ranks exit 1 (no traceback, no hang), and
the checkpoint of the last good state is complete.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from tests.conftest import meshforge_cmd, read_metrics, worker_env

pytestmark = pytest.mark.slow

EXPLODE = [
    "--training.steps=12",
    "--lr_scheduler.learning_rate=1e6",
    "--training.max_norm=1e30",
    "--lr_scheduler.warmup_steps=0",
    "--monitor.health_checkpoint.global_norm_skip_time=3",
    "--monitor.health_checkpoint.global_norm_skip_threshold=1e12",
    "--checkpoint.save_interleaved_steps=100",
]


@pytest.mark.parametrize("layout", [[], ["--parallelism.pipeline_parallel=2"]], ids=["dp2", "pp2"])
def test_two_ranks_skip_and_stop_at_the_same_step(
    tiny_config: Path, tmp_path: Path, layout: list[str]
) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            *meshforge_cmd(nproc=2),
            "train",
            "--config",
            str(tiny_config),
            f"--training.output_dir={out}",
            *EXPLODE,
            *layout,
        ],
        cwd=tmp_path,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr  # rank 0 reports; rank 1 stops silently
    assert errors[0].startswith("error: monitor.health_checkpoint: 3 consecutive steps skipped"), errors[0]
    # Both workers ended with the trainer's exit status, not with a Python exception of ours
    # (torchrun prints its own summary of failed workers).
    assert proc.stderr.count("exitcode  : 1 ") == 2, proc.stderr
    assert "meshforge/train/" not in proc.stderr and "meshforge/health" not in proc.stderr
    records = read_metrics(out)
    last = records[-1]["step"]
    assert [r["step"] for r in records] == list(range(1, last + 1))
    assert [r.get("skipped", False) for r in records[-3:]] == [True, True, True]
    assert not records[-4].get("skipped", False)
    for r in records:
        assert r["loss"] is None or math.isfinite(r["loss"]), r
        assert r["grad_norm"] is None or math.isfinite(r["grad_norm"]), r
    saved = out / "checkpoints" / f"checkpoint-{last:08d}"
    assert (saved / "COMPLETE").is_file()
    assert sorted(p.name for p in (saved / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    assert f"weights after step {last - 3}" in errors[0]
