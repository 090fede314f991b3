"""Resume from DCP checkpoints: RNG restore, incomplete folders, damaged files, background saves.

The runs train the tiny model with attention dropout, so a resumed run equals the uninterrupted
one only when every RNG is restored, and differs when it is not.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.conftest import read_metrics, train_four_steps


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"checkpoint-{step:08d}"


def _resume(config: Path, out: Path, load_path: Path) -> subprocess.CompletedProcess[str]:
    proc = train_four_steps(config, out, f"--checkpoint.load_path={load_path}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _refused(config: Path, out: Path, load_path: Path) -> str:
    proc = train_four_steps(config, out, f"--checkpoint.load_path={load_path}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr


@pytest.mark.slow  # whole trainings
def test_resume_with_dropout_is_exact_only_with_the_rng_state(
    four_step_run: tuple[Path, Path, list[dict]],
) -> None:
    config, run, full = four_step_run
    resumed_dir = run.parent / "resumed"
    _resume(config, resumed_dir, _step(run, 2))
    resumed = read_metrics(resumed_dir)
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in full[2:]]

    # The same checkpoint without its RNG files: the dropout masks differ from step 3 on.
    no_rng = run.parent / "no_rng_ckpt"
    shutil.copytree(_step(run, 2), no_rng)
    shutil.rmtree(no_rng / "rng")
    # Files missing from a folder that lists them are damage (test_checkpoint_damage.py): this
    # one is as a checkpoint written before manifests were.
    (no_rng / "manifest.json").unlink()
    fresh_dir = run.parent / "fresh_rng"
    proc = _resume(config, fresh_dir, no_rng)
    assert "has no RNG state" in proc.stdout
    fresh = read_metrics(fresh_dir)
    assert [r["step"] for r in fresh] == [3, 4]
    assert fresh[0]["loss"] != full[2]["loss"]


@pytest.mark.slow  # whole trainings
def test_incomplete_step_folder_is_skipped_and_replaced(four_step_run: tuple[Path, Path, list[dict]]) -> None:
    config, run, full = four_step_run
    copy = run.parent / "crashed"
    shutil.copytree(run, copy)
    (_step(copy, 4) / "COMPLETE").unlink()
    # Naming the incomplete step folder itself is refused.
    err = _refused(config, run.parent / "refused", _step(copy, 4))
    assert f"{_step(copy, 4)} has no COMPLETE marker" in err
    # The run folder resumes from the latest complete step (2), and the save of step 4
    # replaces the incomplete folder.
    proc = _resume(config, copy, copy)
    assert f"resumed from {_step(copy, 2)} at step 2" in proc.stdout
    again = read_metrics(copy)
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    assert [r["loss"] for r in again] == [r["loss"] for r in full]
    assert (_step(copy, 4) / "COMPLETE").is_file()


@pytest.mark.slow  # whole trainings
def test_damaged_checkpoint_files_are_named(four_step_run: tuple[Path, Path, list[dict]]) -> None:
    config, run, _ = four_step_run
    for name, damage, expected in (
        (".metadata", "truncate", "the DCP checkpoint metadata cannot be read"),
        ("trainer_state.json", '{"step": 2,', "not valid JSON"),
        ("trainer_state.json", '{"step": "two"}', "`step` must be a non-negative integer"),
        ("rng/rank_00000.pt", "truncate", "the saved RNG state cannot be read"),
        ("rng/rank_00000.pt", "truncate+manifest", "bytes where the save wrote"),
        ("__0_0.distcp", "truncate+manifest", "bytes where the save wrote"),
        ("__0_0.distcp", "truncate", "bytes where .metadata needs"),
    ):
        step = run.parent / f"damaged-{len(list(run.parent.glob('damaged-*')))}"
        shutil.copytree(_step(run, 2), step)
        # Without its manifest, as a checkpoint written before manifests were: the readers and
        # the byte ranges of `.metadata` still name the file.
        if not damage.endswith("+manifest"):
            (step / "manifest.json").unlink()
        damage = damage.removesuffix("+manifest")
        file = step / name
        if damage == "truncate":
            data = file.read_bytes()
            file.write_bytes(data[: len(data) // 2])
        else:
            file.write_text(damage)
        err = _refused(config, run.parent / f"out-{step.name}", step)
        assert re.search(rf"error: {re.escape(str(file))}: ([0-9,]+ )?{re.escape(expected)}", err), err


def test_async_save_writes_in_the_background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`save()` returns while the write is still running on another thread; `finalize()` completes it."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from meshforge.checkpoint.manager import CheckpointManager, is_complete, list_complete_steps
    from meshforge.utils.seed import rng_state

    started_here = not dist.is_initialized()
    if started_here:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    release = threading.Event()
    writer_threads: list[int] = []
    write_data = FileSystemWriter.write_data

    def held_write(self: FileSystemWriter, *args: object, **kwargs: object) -> object:
        writer_threads.append(threading.get_ident())
        assert release.wait(timeout=60), "the test never released the write"
        return write_data(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", held_write)
    try:
        model = nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        manager = CheckpointManager(
            save_dir=tmp_path,
            prefix="ckpt",
            interval=1,
            keep=None,
            enabled=True,
            save_optimizer=True,
            rank=0,
            async_save=True,
            log=lambda _msg: None,
        )
        target = manager.save(1, model, optimizer, {"step": 1}, rng_state())
        # Back in the caller while the write is held: the save runs in the background.
        assert not is_complete(target)
        deadline = time.monotonic() + 30
        while not writer_threads and time.monotonic() < deadline:
            time.sleep(0.05)
        assert writer_threads, "the write never started"
        assert writer_threads[0] != threading.get_ident()
        assert not is_complete(target)
        release.set()
        manager.finalize()
        assert is_complete(target)
        assert [step for step, _ in list_complete_steps(tmp_path)] == [1]
    finally:
        release.set()
        if started_here:
            dist.destroy_process_group()
