"""A worker killed twice under `torchrun --max-restarts 3`: the run resumes itself and ends as an uninterrupted one.

`checkpoint.load_path: auto` is what makes a restart continue the run: the first start finds no
checkpoint and starts at step 0, every later start resumes the newest complete one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import read_metrics, run_train, worker_env
from tests.distributed.test_preemption import _children, _rank_of, _records

pytestmark = pytest.mark.slow

STEPS = 14


def _kill_after(
    proc: subprocess.Popen[bytes], out: Path, rank: int, records: int, spared: set[int], stderr: Path
) -> int:
    """SIGKILL `rank` of the current attempt (a worker not in `spared`) once `records` steps are logged."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        workers = {_rank_of(pid): pid for pid in _children(proc.pid) if pid not in spared}
        if rank in workers and _records(out) >= records:
            os.kill(workers[rank], signal.SIGKILL)
            return workers[rank]
        time.sleep(0.02)
    raise AssertionError(
        f"no rank {rank} at {records} records (exit {proc.poll()}):\n{stderr.read_text()[-5000:]}"
    )


@pytest.mark.parametrize("nproc", [1, 2])
def test_two_sigkills_under_max_restarts_end_as_the_uninterrupted_run(
    tiny_config: Path, tmp_path: Path, nproc: int
) -> None:
    common = [f"--training.steps={STEPS}", "--checkpoint.save_interleaved_steps=2", "--checkpoint.save_max=2"]
    full = tmp_path / "full"
    run_train(tiny_config, [*common, f"--training.output_dir={full}"], nproc=nproc, cwd=tmp_path)

    out = tmp_path / "killed"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=3",
        "-m", "meshforge", "train", "--config", str(tiny_config), *common,
        f"--training.output_dir={out}", "--checkpoint.load_path=auto",
    ]  # fmt: skip
    # Files, not pipes: nobody reads a pipe until the end, and the failed attempts' tracebacks fill one.
    log_out, log_err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with log_out.open("w") as stdout_file, log_err.open("w") as stderr_file:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=worker_env(), stdout=stdout_file, stderr=stderr_file)
        try:
            first = _kill_after(proc, out, nproc - 1, 5, set(), log_err)
            # The restarted attempt truncates metrics.jsonl to its checkpoint's step and logs on from there.
            _kill_after(proc, out, nproc - 1, 10, {first}, log_err)
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    stdout, stderr = log_out.read_text(), log_err.read_text()
    assert proc.returncode == 0, stdout + stderr
    assert stdout.count("checkpoint.load_path auto: no complete checkpoint") == 1, stdout
    resumed = [line for line in stdout.splitlines() if "checkpoint.load_path auto: resuming" in line]
    assert len(resumed) == 2, stdout
    reference, records = read_metrics(full), read_metrics(out)
    # Every log step of a several-rank run carries the spread of its step time (monitor/stragglers.py).
    for record in reference:
        spread = (record.get("step_time_median_s"), record.get("step_time_max_s"), record.get("slowest_rank"))
        if nproc == 1:
            assert spread == (None, None, None)
        else:
            assert spread[2] in (0, 1) and 0 < spread[0] <= spread[1], record
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr"):  # bitwise: JSON floats round-trip exactly
        assert [r[key] for r in records] == [r[key] for r in reference], key
