"""FSDP2 data parallel equals one process, and resume is exact, with 1 and 2 processes.

Resume protocol: A trains 2k steps; B trains k steps; C resumes B to 2k steps. C's
losses for steps k+1..2k must equal A's bitwise (deterministic mode, CPU). The 2-process run A
must match the 1-process run A within 1e-5 relative (same global batch and seed). B saves
asynchronously, so the background path is held to the same standard. The runs are whole trainer
runs in-process (`train_all`: here for 1 process, in the shared rank pool for 2).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_metrics
from tests.distributed._layouts import Run, train_all

pytestmark = pytest.mark.slow

K = 3


def _protocol(config: Path, root: Path, nproc: int) -> tuple[list[dict], list[dict]]:
    a, b, c = root / f"a{nproc}", root / f"b{nproc}", root / f"c{nproc}"
    log = root / f"b{nproc}.log"
    # B saves in the background (checkpoint.async_save): its checkpoint must resume exactly too.
    saving = [f"--training.steps={K}", f"--training.output_dir={b}", "--checkpoint.async_save=true"]
    resuming = [
        f"--training.steps={2 * K}",
        f"--training.output_dir={c}",
        f"--checkpoint.load_path={b / 'checkpoints'}",
    ]
    train_all(
        [
            Run(config, [f"--training.steps={2 * K}", f"--training.output_dir={a}"], nproc),
            Run(config, saving, nproc, log),
            Run(config, resuming, nproc),
        ]
    )
    # The save was handed to the background writer and completed before the run ended (the
    # thread itself is checked in tests/unit/test_checkpoint_resume.py).
    assert f"checkpoint: started saving step {K}" in log.read_text()
    assert f"checkpoint: background save of step {K} finished" in log.read_text()
    assert (b / "checkpoints" / f"checkpoint-{K:08d}" / "COMPLETE").is_file()
    return read_metrics(a), read_metrics(c)


def test_one_and_two_processes_resume_exactly_and_agree(tiny_config: Path, tmp_path: Path) -> None:
    full1, resumed1 = _protocol(tiny_config, tmp_path, 1)
    full2, resumed2 = _protocol(tiny_config, tmp_path, 2)

    for full, resumed in ((full1, resumed1), (full2, resumed2)):
        assert [r["step"] for r in full] == list(range(1, 2 * K + 1))
        assert [r["step"] for r in resumed] == list(range(K + 1, 2 * K + 1))
        # Bitwise: the JSON floats round-trip exactly.
        assert [r["loss"] for r in resumed] == [r["loss"] for r in full[K:]]
        assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in full[K:]]
        assert [r["lr"] for r in resumed] == [r["lr"] for r in full[K:]]

    # FSDP over 2 ranks (no accumulation) == 1 process with 2 accumulation micro-batches.
    for one, two in zip(full1, full2, strict=True):
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
        assert two["tokens"] == one["tokens"]
    assert full1[-1]["loss"] < full1[0]["loss"]
