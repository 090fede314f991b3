"""HSDP (replicate x shard mesh) equals one process, and its checkpoint resumes in another layout.

Whole trainer runs in-process (`train_all`: the 2-rank run in the shared rank pool).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_metrics
from tests.distributed._layouts import Run, train_all

pytestmark = pytest.mark.slow


def test_hsdp_2x1_equals_one_process_and_resumes_on_one(tiny_config: Path, tmp_path: Path) -> None:
    common = ["--training.steps=4", "--checkpoint.save_interleaved_steps=2"]
    one, hsdp, moved = tmp_path / "one", tmp_path / "hsdp", tmp_path / "moved"
    log = tmp_path / "hsdp.log"
    hsdp_args = [*common, f"--training.output_dir={hsdp}", "--parallelism.data_parallel_shard=1"]
    train_all(
        [Run(tiny_config, [*common, f"--training.output_dir={one}"]), Run(tiny_config, hsdp_args, 2, log)]
    )
    assert "HSDP: 2 replicas" in log.read_text()
    a, b = read_metrics(one), read_metrics(hsdp)
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)

    # The HSDP checkpoint of step 2 continues in a single process with the same losses.
    step2 = hsdp / "checkpoints" / "checkpoint-00000002"
    train_all(
        [Run(tiny_config, [*common, f"--training.output_dir={moved}", f"--checkpoint.load_path={step2}"])]
    )
    c = read_metrics(moved)
    assert [r["step"] for r in c] == [3, 4]
    for x, y in zip(b[2:], c, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
