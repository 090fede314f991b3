"""A run never writes over an earlier run's results unless asked (tests/unit, in-process runs).

Into a folder an earlier run left: refused with one line naming the folder and the ways on;
`checkpoint.load_path: auto` resumes its latest checkpoint (a fresh folder starts at step 0);
`training.overwrite_output_dir: true` starts over, removing the earlier checkpoints and metrics;
checkpoint rotation never removes a later step than the one it just saved (another run's).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshforge.checkpoint.manager import list_complete_steps
from tests._process_group import leave_no_process_group  # noqa: F401 (a fixture)
from tests.conftest import read_metrics, train_here

pytestmark = [pytest.mark.usefixtures("leave_no_process_group"), pytest.mark.slow]

SHORT = ["--training.log_interval=1", "--model.num_hidden_layers=1", "--checkpoint.save_interleaved_steps=2"]


def _steps(run: Path) -> list[int]:
    return [step for step, _ in list_complete_steps(run / "checkpoints")]


def test_an_earlier_run_is_refused_then_resumed_or_replaced(tiny_config: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = [*SHORT, f"--training.output_dir={run}", "--checkpoint.save_max=2"]
    train_here(tiny_config, [*first, "--training.steps=4"])
    assert _steps(run) == [2, 4] and len(read_metrics(run)) == 4

    with pytest.raises(ValueError) as refused:
        train_here(tiny_config, [*first, "--training.steps=2"])
    message = str(refused.value)
    assert f"training.output_dir: {run} holds an earlier run" in message
    assert "--checkpoint.load_path auto" in message and "--training.overwrite_output_dir true" in message
    assert _steps(run) == [2, 4] and len(read_metrics(run)) == 4  # nothing touched

    lines: list[str] = []
    train_here(tiny_config, [*first, "--training.steps=6", "--checkpoint.load_path=auto"], log=lines.append)
    assert any(f"checkpoint.load_path auto: resuming {run / 'checkpoints'}" in line for line in lines)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5, 6]
    assert _steps(run) == [4, 6]

    lines.clear()
    train_here(
        tiny_config, [*first, "--training.steps=2", "--training.overwrite_output_dir=true"], log=lines.append
    )
    assert any("removing the earlier run's 2 checkpoint(s) and 6 metrics record(s)" in line for line in lines)
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert _steps(run) == [2]


def test_auto_in_a_fresh_folder_starts_at_step_zero(tiny_config: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    run = tmp_path / "fresh"
    train_here(
        tiny_config,
        [*SHORT, f"--training.output_dir={run}", "--training.steps=2", "--checkpoint.load_path=auto"],
        log=lines.append,
    )
    assert any("no complete checkpoint" in line and "starting at step 0" in line for line in lines)
    assert [r["step"] for r in read_metrics(run)] == [1, 2]


def test_rotation_keeps_a_later_step_of_another_run(tiny_config: Path, tmp_path: Path) -> None:
    """Resumed from an earlier step, the run's saves never rotate out the abandoned later steps."""
    run = tmp_path / "run"
    common = [*SHORT, f"--training.output_dir={run}", "--checkpoint.save_max=1"]
    train_here(tiny_config, [*common, "--checkpoint.save_max=null", "--training.steps=6"])
    assert _steps(run) == [2, 4, 6]
    step2 = run / "checkpoints" / "checkpoint-00000002"
    train_here(tiny_config, [*common, "--training.steps=4", f"--checkpoint.load_path={step2}"])
    assert _steps(run) == [4, 6]  # step 2 rotated out by this run's step 4; step 6 is kept


def test_the_resume_command_repeats_the_launch_and_loads_the_latest_checkpoint():
    from meshforge.train.output_dir import resume_command

    overrides = ["training.steps=20", "training.overwrite_output_dir=true", "training.output_dir=run x"]
    one = resume_command("configs/demo.yaml", overrides, fmt=None, world_size=1, local_world_size=1)
    assert one == (
        "meshforge train --config configs/demo.yaml --training.steps=20 '--training.output_dir=run x' "
        "--checkpoint.load_path auto"
    )
    two = resume_command(None, ["checkpoint.load_path=x"], fmt="native", world_size=2, local_world_size=2)
    assert two == "torchrun --nproc-per-node 2 -m meshforge train --format native --checkpoint.load_path auto"
    nodes = resume_command("c.yaml", [], fmt=None, world_size=16, local_world_size=8)
    assert nodes.startswith("torchrun --nnodes 2 --nproc-per-node 8 <rendezvous flags> -m meshforge train")
