"""SIGTERM to one rank of a 2-process run: both finish the step, save, exit 0; resume is bitwise.

The signal goes to rank 1 only: rank 0 learns of it through the step's decision all-reduce.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import meshforge_cmd, read_metrics, run_train, worker_env

pytestmark = pytest.mark.slow

STEPS = 40


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _records(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_sigterm_to_one_rank_saves_and_resume_is_bitwise(tiny_config: Path, tmp_path: Path) -> None:
    common = [f"--training.steps={STEPS}", "--checkpoint.save_interleaved_steps=1000"]
    full = tmp_path / "full"
    run_train(tiny_config, [*common, f"--training.output_dir={full}"], nproc=2, cwd=tmp_path)

    out = tmp_path / "preempted"
    cmd = [
        *meshforge_cmd(nproc=2),
        "train",
        "--config",
        str(tiny_config),
        *common,
        f"--training.output_dir={out}",
    ]
    env = worker_env()
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while _records(out) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        workers = {_rank_of(pid): pid for pid in _children(proc.pid)}
        assert 1 in workers, (workers, proc.poll())
        os.kill(workers[1], signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout + stderr
    assert "SIGTERM received: finishing this step" in stderr
    found = re.findall(r"^(?:\[rank0\] )?preempted at step (\d+): checkpoint (\S+)$", stdout, flags=re.M)
    assert len(found) == 1, stdout
    step, where = int(found[0][0]), Path(found[0][1])
    assert 3 <= step < STEPS
    assert where == out / "checkpoints" / f"checkpoint-{step:08d}"
    assert (where / "COMPLETE").is_file()
    assert "Done:" not in stdout
    assert [r["step"] for r in read_metrics(out)] == list(range(1, step + 1))

    # The printed resume command, run as it is (its launcher, torchrun, given by the test's own):
    # the run continues in its own folder from its latest checkpoint.
    printed = re.findall(r"^(?:\[rank0\] )?to resume: (.+)$", stdout, flags=re.M)
    assert len(printed) == 1, stdout
    words = shlex.split(printed[0])
    assert words[:5] == ["torchrun", "--nproc-per-node", "2", "-m", "meshforge"], printed
    assert words[-2:] == ["--checkpoint.load_path", "auto"]
    relaunch = [*meshforge_cmd(nproc=2), *words[5:]]
    done = subprocess.run(relaunch, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    reference, records = read_metrics(full), read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    after = records[step:]
    # Bitwise: the JSON floats round-trip exactly.
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in after] == [r[key] for r in reference[step:]], key
