"""The run's checkpoint saves as a built-in, always-on callback.

Where a step saves is fixed by the loop's order: after the health and preemption verdicts and
the metrics of the step (`on_step_end`: the `checkpoint.save_interval` steps, the last step, a
preempted step), then once more after the ranks agreed on the user callbacks' requests
(`on_step_close`: a requested save, or the checkpoint of a requested stop). Every rank calls it
at the same points, as the save is collective.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshforge.train.callbacks import BuiltinCallback
from meshforge.utils.seed import rng_state

if TYPE_CHECKING:
    import torch

    from meshforge.checkpoint.manager import CheckpointManager, TrainerState


class CheckpointSaver(BuiltinCallback):
    """Saves the model, the optimizer and the trainer's state through the checkpoint manager."""

    config_name = "checkpoint (built in)"

    def __init__(
        self,
        checkpointer: CheckpointManager,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: Callable[[], TrainerState],
        preempted: Callable[[], bool],
        total_steps: int,
        log: Callable[[str], None],
        on_save: Callable[[Path], None],
    ) -> None:
        super().__init__()
        self.checkpointer = checkpointer
        self.model = model
        self.optimizer = optimizer
        self.trainer_state = trainer_state
        self.preempted = preempted
        self.total_steps = total_steps
        self.log = log
        self.on_save_done = on_save
        self.last_path: Path | None = None

    def on_step_end(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        if self.checkpointer.should_save(step, self.total_steps) or (
            self.preempted() and self.checkpointer.last_saved_step != step
        ):
            # A preempted run saves whatever checkpoint.enable_save says: it is the way back.
            self.save()

    def on_step_close(self, step: int, *, save: bool, stop: bool) -> None:
        # A requested stop ends the run as a last step would: with its checkpoint when saving is on.
        if (save or (stop and self.checkpointer.enabled)) and self.checkpointer.last_saved_step != step:
            self.save()

    def save(self) -> Path | None:
        """Save now (collective); the user callbacks' `on_save` get the folder. None: the save
        failed and `checkpoint.on_save_error: continue` goes on (the manager logged why)."""
        state = self.trainer_state()
        path = self.checkpointer.save(state["step"], self.model, self.optimizer, state, rng_state())
        if path is None:
            return None
        self.last_path = path
        how = "started saving" if self.checkpointer.async_save else "saved"
        self.log(f"checkpoint: {how} step {state['step']} to {path}")
        self.on_save_done(path)
        return path
