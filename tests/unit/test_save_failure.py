"""A save that cannot be written: one line naming the path and the free space, earlier checkpoints intact.

The fault is injected where DCP writes a tensor to its file (half of it written, then ENOSPC),
and once for real on a tmpfs too small for a second checkpoint where this machine lets a test
mount one (a private mount namespace: nothing outlives the test's process).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint.filesystem as dcp_filesystem

from meshforge.checkpoint.integrity import damage
from tests.conftest import DROPOUT, read_metrics, train_four_steps, worker_env


def _step(root: Path, step: int) -> Path:
    return root / f"checkpoint-{step:08d}"


def _fail_writes_of_step(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    real = dcp_filesystem._write_item

    def write_item(transforms: Any, stream: Any, data: Any, *args: Any) -> Any:
        name = str(getattr(stream, "name", ""))
        if f"checkpoint-{step:08d}" in name:
            stream.write(b"\0" * 64)  # a partial write, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        return real(transforms, stream, data, *args)

    monkeypatch.setattr(dcp_filesystem, "_write_item", write_item)


@pytest.mark.slow  # whole trainings
def test_a_full_disk_stops_the_run_and_keeps_the_last_checkpoint(
    four_step_run: tuple[Path, Path, list[dict]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, _, full = four_step_run
    out = tmp_path / "run"
    out.mkdir()
    _fail_writes_of_step(monkeypatch, 4)
    proc = train_four_steps(config, out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    ckpts = out / "checkpoints"
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(
        rf"error: checkpoint: saving step 4 to {re.escape(str(_step(ckpts, 4)))} failed: No space left on "
        rf"device \({re.escape(str(_step(ckpts, 4)))}/__0_0\.distcp\) \([0-9,.]+ MiB free there\); the last "
        rf"complete checkpoint is {re.escape(str(_step(ckpts, 2)))}; stopping \(checkpoint.on_save_error: stop\)",
        lines[0],
    ), lines[0]
    assert "Traceback" not in proc.stderr
    assert not _step(ckpts, 4).exists()  # the half-written folder is gone
    assert damage(_step(ckpts, 2)) is None
    monkeypatch.undo()
    resumed = train_four_steps(config, out, "--checkpoint.load_path=auto")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in full]


@pytest.mark.slow  # whole trainings
def test_continue_trains_on_after_a_failed_save(
    four_step_run: tuple[Path, Path, list[dict]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, _, full = four_step_run
    out = tmp_path / "run"
    out.mkdir()
    _fail_writes_of_step(monkeypatch, 2)
    proc = train_four_steps(config, out, "--checkpoint.on_save_error=continue")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "no complete checkpoint was saved yet; training goes on (checkpoint.on_save_error: continue)"
        in proc.stdout
    )
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in full]
    ckpts = out / "checkpoints"
    assert not _step(ckpts, 2).exists() and damage(_step(ckpts, 4)) is None


def _can_mount_tmpfs(where: Path) -> list[str] | None:
    """The command prefix that runs a command with a private tmpfs mount, or None on this machine."""
    if shutil.which("unshare") is None:
        return None
    for prefix in (
        ["unshare", "-m", "--propagation", "private"],
        ["unshare", "-rm", "--propagation", "private"],
    ):
        probe = subprocess.run(
            [*prefix, "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {where}"], capture_output=True, timeout=30
        )
        if probe.returncode == 0:
            return prefix
    return None


@pytest.mark.procs
def test_a_real_filesystem_too_small_for_the_second_checkpoint(
    four_step_run: tuple[Path, Path, list[dict]], tmp_path: Path
) -> None:
    config, run, _ = four_step_run
    mount = tmp_path / "small"
    mount.mkdir()
    prefix = _can_mount_tmpfs(mount)
    if prefix is None:
        pytest.skip("this machine lets no test mount a tmpfs (no unshare, or no mount namespaces)")
    listed = json.loads((run / "checkpoints" / "checkpoint-00000002" / "manifest.json").read_text())["files"]
    one = sum(listed.values()) + 64 * 1024
    size_kib = int(one * 1.5) // 1024
    out, kept = tmp_path / "run", tmp_path / "kept"
    train = [
        sys.executable, "-m", "meshforge", "train", "--config", str(config), "--training.steps=4",
        f"--training.output_dir={out}", f"--checkpoint.save_path={mount}", DROPOUT,
    ]  # fmt: skip
    script = (
        f"mount -t tmpfs -o size={size_kib}k tmpfs {mount} && "
        f"{' '.join(train)}; code=$?; cp -a {mount} {kept}; exit $code"
    )
    proc = subprocess.run(
        [*prefix, "sh", "-c", script], env=worker_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # The OS error itself, or torch.save's report of the same short write.
    assert re.search(
        rf"^error: checkpoint: saving step 4 to {re.escape(str(_step(mount, 4)))} failed: (No space left on "
        r"device|a file stopped short .*: no space left on the device\?) \([0-9.,]+ MiB free there\)",
        proc.stderr,
        flags=re.M,
    ), proc.stderr
    assert f"the last complete checkpoint is {_step(mount, 2)}" in proc.stderr
    assert not _step(kept, 4).exists()
    assert damage(_step(kept, 2)) is None
