"""What a run may do with its output folder: start in it, resume the run it holds, or start over.

A folder that holds an earlier run (records in its `metrics.jsonl`, or complete checkpoints) is
never written over without being asked: `checkpoint.load_path: auto` resumes its newest complete
checkpoint that loads whole (torchtitan's habit; a damaged newer one is passed over and named,
`checkpoint/integrity.py`), a `load_path` inside the folder resumes that step,
`training.overwrite_output_dir: true` starts over in it (the HF Trainer's key: the earlier
checkpoints and metrics are removed, and the log says so), and anything else is refused in one
line that names the folder and these ways on (LLaMA-Factory refuses too). `auto` in a folder
without a checkpoint starts at step 0.
"""

from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from meshforge.checkpoint.config import CheckpointConfig
from meshforge.checkpoint.integrity import newest_sound
from meshforge.checkpoint.manager import list_complete_steps
from meshforge.config.root import TrainConfig
from meshforge.utils.resources import resolve_path

AUTO = "auto"


@dataclass(frozen=True)
class OutputClaim:
    """The decision: what to load ("" for nothing), what to remove first, and the line to log."""

    load_path: str
    remove: tuple[Path, ...] = ()
    note: str | None = None


def checkpoint_folder(ckpt: CheckpointConfig, output_dir: Path) -> Path:
    """Where the run's step folders go (`checkpoint.save_path`, else `{output_dir}/checkpoints`)."""
    return resolve_path(ckpt.save_path) if ckpt.save_path else output_dir / "checkpoints"


def _metric_records(output_dir: Path) -> int:
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip())


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or path.is_relative_to(folder)


def claim_output_dir(cfg: TrainConfig, output_dir: Path) -> OutputClaim:
    """Decide, reading only, how this run uses `output_dir` (every rank decides the same).

    Raises:
        ValueError: the folder holds an earlier run and nothing says what to do with it.
    """
    save_dir = checkpoint_folder(cfg.checkpoint, output_dir)
    records = _metric_records(output_dir)
    steps = list_complete_steps(save_dir)
    load = cfg.checkpoint.load_path
    if load == AUTO:
        damaged: list[str] = []
        sound = newest_sound(steps, log=damaged.append)
        passed = "".join(f"{line}; " for line in damaged)
        if sound is not None:
            return OutputClaim(str(sound[1]), note=f"{passed}checkpoint.load_path auto: resuming {sound[1]}")
        if steps:
            raise ValueError(
                f"checkpoint.load_path auto: every complete checkpoint in {save_dir} is damaged "
                f"({'; '.join(damaged)}); name a step folder to load, or start over with "
                "--training.overwrite_output_dir true"
            )
        note = f"checkpoint.load_path auto: no complete checkpoint in {save_dir}; starting at step 0"
        if not records:
            return OutputClaim("", note=note)
        load = ""
    if not records and not steps:
        return OutputClaim(load)
    if load and any(_inside(resolve_path(load), folder) for folder in (output_dir, save_dir)):
        return OutputClaim(load)  # resuming this folder's own run
    if cfg.training.overwrite_output_dir:
        remove = tuple(path for _, path in steps)
        metrics = output_dir / "metrics.jsonl"
        if records:
            remove += (metrics,)
        note = (
            f"training.overwrite_output_dir: starting over in {output_dir}: removing the earlier run's "
            f"{len(steps)} checkpoint(s) and {records} metrics record(s)"
        )
        return OutputClaim(load, remove, note)
    held = [f"{records} metrics records"] if records else []
    if steps:
        held.append(f"checkpoints up to step {steps[-1][0]} in {save_dir}")
    raise ValueError(
        f"training.output_dir: {output_dir} holds an earlier run ({', '.join(held)}); resume it with "
        "--checkpoint.load_path auto, start over in it with --training.overwrite_output_dir true, or "
        "choose another --training.output_dir"
    )


# Overrides a resume must not repeat: it loads the latest checkpoint, and keeps what is in the folder.
_NOT_REPEATED = ("training.overwrite_output_dir", "checkpoint.load_path")


def resume_command(
    config: str | None, overrides: list[str], *, fmt: str | None, world_size: int, local_world_size: int
) -> str:
    """The command line that resumes a preempted run: its own launch, loading the latest checkpoint.

    `config` and `overrides` (`key=value` strings) are those of the launch, paths as the user gave
    them (so the command runs from the same folder); `overwrite_output_dir` and `load_path` are
    replaced by `--checkpoint.load_path auto`. Several processes launch under torchrun with this
    launch's per-node count (several nodes keep their own rendezvous flags).
    """
    words = ["meshforge", "train"]
    if config is not None:
        words += ["--config", config]
    if fmt is not None:
        words += ["--format", fmt]
    words += [f"--{item}" for item in overrides if item.split("=", 1)[0] not in _NOT_REPEATED]
    words += ["--checkpoint.load_path", AUTO]
    line = shlex.join(words)
    if world_size <= 1:
        return line
    launcher = f"torchrun --nproc-per-node {local_world_size}"
    if world_size > local_world_size:
        nodes = world_size // max(1, local_world_size)
        launcher = f"torchrun --nnodes {nodes} --nproc-per-node {local_world_size} <rendezvous flags>"
    return f"{launcher} -m {line}"


def remove_earlier_run(claim: OutputClaim) -> None:
    """Delete what `claim` names (rank 0 only, after every rank decided)."""
    for path in claim.remove:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
