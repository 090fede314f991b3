"""scripts/launch.sh: the single-node launcher (the reference's msrun) runs meshforge on N processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import read_metrics

LAUNCH = Path(__file__).resolve().parents[2] / "scripts" / "launch.sh"


def _launch(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MESHFORGE_PYTHON=sys.executable)
    return subprocess.run(
        ["bash", str(LAUNCH), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_launch_usage_errors(tmp_path: Path) -> None:
    assert _launch([], tmp_path).returncode == 2
    bad = _launch(["meshforge train", "two"], tmp_path)
    assert bad.returncode == 2 and "positive integer" in bad.stderr
    other = _launch(["python train.py", "2"], tmp_path)
    assert other.returncode == 2 and "must start with 'meshforge'" in other.stderr


@pytest.mark.slow
def test_launch_trains_on_two_processes(tiny_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _launch(
        [f"meshforge train --config {tiny_config} --training.steps=2 --training.output_dir={out}", "2"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "world=2" in proc.stdout + proc.stderr
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
