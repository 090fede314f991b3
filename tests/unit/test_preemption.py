"""The preemption guard: the first signal is a request, a repeat within a second the same one,
a later one exits at once; a preempted run stops after the step with a checkpoint."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from meshforge.train.preemption import PreemptionGuard
from tests._process_group import leave_no_process_group  # noqa: F401 (a fixture)
from tests.conftest import meshforge_here, read_metrics

SCRIPT = textwrap.dedent(
    """
    import os, signal, time
    from meshforge.train.preemption import PreemptionGuard

    guard = PreemptionGuard()
    guard.install()
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    print("requested", guard.requested, guard.signal_name, flush=True)
    os.kill(os.getpid(), signal.SIGINT)  # within the repeat window: the same request
    time.sleep(0.05)
    print("still running", flush=True)
    time.sleep(1.2)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
    print("not reached", flush=True)
    """
)


@pytest.mark.procs
def test_a_second_signal_exits_at_once() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["requested True SIGINT", "still running"]
    assert "SIGINT received: finishing this step and saving a checkpoint" in proc.stderr
    assert "SIGTERM received again: exiting now, without a checkpoint" in proc.stderr


def test_install_and_uninstall_restore_the_previous_handlers() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    guard = PreemptionGuard()
    guard.install()
    assert signal.getsignal(signal.SIGTERM) == guard._handle
    guard.uninstall()
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert not guard.requested


@pytest.mark.usefixtures("leave_no_process_group")
def test_a_signal_during_a_run_stops_after_that_step_with_a_checkpoint(tiny_config: Path) -> None:
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    out = tiny_config.parent / "preempt"
    overrides = ["training.steps=6", f"training.output_dir={out}", "checkpoint.enable_save=false"]
    lines: list[str] = []
    trainer = Trainer(load_config(str(tiny_config), overrides), log=lines.append)
    trainer.setup()
    log_step = trainer.log_step

    def signal_at_step_2(record: dict[str, Any]) -> None:
        log_step(record)
        if record["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    trainer.log_step = signal_at_step_2  # type: ignore[method-assign]
    summary = trainer.train()
    # Step 2 had already made its decision: step 3 runs, agrees on the request, and is the last.
    assert summary.preempted
    assert trainer.step == 3 and summary.steps == 3
    where = out / "checkpoints" / "checkpoint-00000003"
    assert summary.last_checkpoint == where
    assert (where / "COMPLETE").is_file()
    assert lines[-1] == f"preempted at step 3: checkpoint {where}"
    assert signal.getsignal(signal.SIGTERM) != trainer.run.watch.preemption._handle
    # The command `meshforge train` prints after this line, run as it is, resumes the run to
    # its end in the same folder.
    from meshforge.cli.main import main
    from meshforge.train.output_dir import resume_command

    command = resume_command(str(tiny_config), overrides, fmt=None, world_size=1, local_world_size=1)
    assert main([*shlex.split(command)[1:], "--checkpoint.enable_save=true"]) == 0
    assert [record["step"] for record in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    # Once more, from its final checkpoint: the run is finished, and the command says so rather
    # than "Done: 0 steps, final loss nan".
    again = meshforge_here(*shlex.split(command)[1:], cwd=tiny_config.parent)
    assert again.returncode == 0, again.stderr
    assert (
        "Done: nothing to train: the run resumed at step 6, which already reached training.steps"
        in again.stdout
    )
    assert "final loss nan" not in again.stdout
