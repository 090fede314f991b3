"""`trainer_state.json`: the loop's part of a checkpoint step, and its reader.

Kept apart from the manager so that the checks of a step folder (`checkpoint/integrity.py`) can
read it without importing the saving and loading machinery.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict, cast

from meshforge.checkpoint.readers import read_json_object

TRAINER_STATE_FILE = "trainer_state.json"

StateDict = dict[str, object]


class TrainerState(TypedDict, total=False):
    """`trainer_state.json`: the trainer's part of a step (`train.build.trainer_state`) and what
    the manager adds (`has_optimizer`, `optimizer_type`, `lora`, `model`: what model it holds,
    `checkpoint/identity.py`). Empty for a weights-only load."""

    step: int
    tokens_seen: int
    scheduler: StateDict
    data: dict[str, int]  # the loader's position (bools as ints: shuffle, stream)
    world_size: int
    global_batch_size: int
    has_optimizer: bool
    optimizer_type: str
    lora: StateDict
    model: StateDict


def read_trainer_state(step_dir: Path) -> TrainerState:
    """`trainer_state.json` of a step folder (step, tokens seen, schedule and data position).

    Raises:
        FileNotFoundError: when the folder has none.
        ValueError: naming the file, when it is not a JSON object or has no integer `step`.
    """
    file = step_dir / TRAINER_STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"checkpoint.load_path: {step_dir} has no {TRAINER_STATE_FILE} (not a meshforge checkpoint folder)"
        )
    state = read_json_object(file)
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"{file}: `step` must be a non-negative integer, got {step!r}")
    # The file is this module's own writing; only `step` is checked (older checkpoints lack keys).
    return cast("TrainerState", state)
