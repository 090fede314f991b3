"""A damaged latest checkpoint: `auto` resumes the one before and names the bad file; nothing loads in part."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from meshforge.checkpoint.integrity import damage, newest_sound
from tests.conftest import read_metrics, train_four_steps


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"checkpoint-{step:08d}"


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


@pytest.mark.slow  # whole trainings
def test_auto_passes_over_a_damaged_latest_checkpoint(four_step_run: tuple[Path, Path, list[dict]]) -> None:
    config, run, full = four_step_run
    copy = run.parent / "damaged-latest"
    shutil.copytree(run, copy)
    shard = _step(copy, 4) / "__0_0.distcp"
    _truncate(shard)
    proc = train_four_steps(config, copy, "--checkpoint.load_path=auto", "--training.steps=4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"checkpoint: skipping damaged step 4: {shard}: " in proc.stdout
    assert f"checkpoint.load_path auto: resuming {_step(copy, 2)}" in proc.stdout
    again = read_metrics(copy)
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    assert [r["loss"] for r in again] == [r["loss"] for r in full]
    # The step-4 save replaced the damaged folder with a sound one.
    assert damage(_step(copy, 4)) is None


@pytest.mark.slow  # whole trainings
def test_every_checkpoint_damaged_or_a_damaged_step_named_is_an_error(
    four_step_run: tuple[Path, Path, list[dict]],
) -> None:
    config, run, _ = four_step_run
    copy = run.parent / "all-damaged"
    shutil.copytree(run, copy)
    (_step(copy, 4) / ".metadata").write_bytes(b"not a pickle")
    (_step(copy, 2) / "rng" / "rank_00000.pt").unlink()
    proc = train_four_steps(config, copy, "--checkpoint.load_path=auto")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "every complete checkpoint in" in proc.stderr
    assert f"{_step(copy, 2) / 'rng' / 'rank_00000.pt'}: missing" in proc.stderr
    assert [r["step"] for r in read_metrics(copy)] == [1, 2, 3, 4]  # the folder is left as it was

    named = train_four_steps(config, run.parent / "named-out", f"--checkpoint.load_path={_step(copy, 4)}")
    assert named.returncode == 2
    assert (
        f"error: {_step(copy, 4) / '.metadata'}: the DCP checkpoint metadata cannot be read" in named.stderr
    )
    assert "is damaged: load another step folder" in named.stderr


def test_damage_names_each_kind_of_fault(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from meshforge.checkpoint.integrity import write_manifest

    step = tmp_path / "checkpoint-00000001"
    dcp.save({"w": torch.arange(64.0)}, checkpoint_id=str(step), no_dist=True)
    (step / "trainer_state.json").write_text('{"step": 1}')
    (step / "extra.bin").write_bytes(b"x" * 10)
    write_manifest(step)
    (step / "COMPLETE").write_text("1\n")
    assert damage(step) is None
    assert newest_sound([(1, step)]) == (1, step)

    (step / "extra.bin").write_bytes(b"x" * 9)
    assert damage(step) == f"{step / 'extra.bin'}: 9 bytes where the save wrote 10 (truncated or changed)"
    (step / "extra.bin").unlink()
    assert damage(step) == f"{step / 'extra.bin'}: missing (the save wrote it: manifest.json lists it)"
    (step / "manifest.json").unlink()  # as before manifests: the metadata's byte ranges still count
    assert damage(step) is None
    shard = next(step.glob("*.distcp"))
    _truncate(shard)
    found = damage(step)
    assert found is not None and found.startswith(f"{shard}: ") and "where .metadata needs" in found
    shard.unlink()
    assert damage(step) == f"{shard}: missing (.metadata names it)"
    logged: list[str] = []
    assert newest_sound([(1, step)], log=logged.append) is None
    assert logged == [f"checkpoint: skipping damaged step 1: {shard}: missing (.metadata names it)"]
