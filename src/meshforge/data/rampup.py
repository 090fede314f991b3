"""Batch-size ramp-up: `training.rampup_batch_size: [start, increment, ramp_samples]` (Megatron).

Megatron's rule (`RampupBatchsizeNumMicroBatchesCalculator`): the global batch of a step is a
function of the samples consumed before it. While `consumed <= ramp_samples` it is
`start + floor(consumed / (ramp_samples / n)) * increment` with `n = (global - start) /
increment` increments; after that it is `training.global_batch_size`. Every size must be a
multiple of `data-parallel ranks x local_batch_size`, since the micro-batch size stays fixed
and only the number of micro-batches per step (the gradient accumulation) grows. The floor is
computed in integers here (`consumed * n // ramp_samples`), which equals Megatron's float
division except where that rounds across an integer.

Because the batch of step k depends only on the samples of the steps before it, the whole
ramp is a fixed sequence: step k's batch, the samples consumed after it, and so the data order
and a resume in the middle of the ramp follow from the step count alone.

Learning-rate schedule: Megatron counts the schedule in samples (its warm-up and decay lengths
are `iters x global_batch_size` samples). Here the schedule's step position after k optimizer
steps is `samples consumed / training.global_batch_size`: the schedule's steps are steps of
the full batch, and a ramped step moves it by its share of a full one. `training.steps` stays
the number of optimizer steps (Megatron sizes a ramped run in samples instead).

Light module: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BatchRampUp"]

_K = "training.rampup_batch_size"


@dataclass
class BatchRampUp:
    """The ramp of one run: batch sizes, accumulation steps and consumed samples per step.

    Args:
        start, increment, ramp_samples: the three values of `training.rampup_batch_size`.
        global_batch_size: `training.global_batch_size`, the size after the ramp.
        micro_samples: samples of one micro-batch over all data-parallel ranks
            (`dp x local_batch_size`).
    """

    start: int
    increment: int
    ramp_samples: int
    global_batch_size: int
    micro_samples: int
    _consumed: list[int] = field(default_factory=lambda: [0], repr=False)

    def __post_init__(self) -> None:
        check_ramp(self.start, self.increment, self.global_batch_size)
        for size in self.sizes():
            if size % self.micro_samples:
                raise ValueError(
                    f"{_K}: the global batch {size} of the ramp {self.sizes()} is not a multiple of "
                    f"data-parallel ranks x training.local_batch_size ({self.micro_samples})"
                )

    @property
    def increments(self) -> int:
        return (self.global_batch_size - self.start) // self.increment

    def sizes(self) -> list[int]:
        """Every global batch size the ramp passes through, the final one included."""
        return [self.start + i * self.increment for i in range(self.increments + 1)]

    def batch_for(self, consumed: int) -> int:
        """The global batch of the step that follows `consumed` samples (Megatron's rule)."""
        n = self.increments
        if n == 0 or self.ramp_samples == 0 or consumed > self.ramp_samples:
            return self.global_batch_size
        return self.start + (consumed * n // self.ramp_samples) * self.increment

    def consumed_after(self, steps: int) -> int:
        """Samples consumed by the first `steps` optimizer steps."""
        while len(self._consumed) <= steps:
            done = self._consumed[-1]
            self._consumed.append(done + self.batch_for(done))
        return self._consumed[steps]

    def batch_at(self, step: int) -> int:
        """The global batch of optimizer step `step` (1-based)."""
        return self.batch_for(self.consumed_after(step - 1))

    def accumulation_at(self, step: int) -> int:
        """Micro-batches per rank of optimizer step `step` (1-based)."""
        return self.batch_at(step) // self.micro_samples

    def schedule_position(self, steps_done: int) -> float:
        """Where the learning-rate schedule stands after `steps_done` steps: full-batch steps."""
        return self.consumed_after(steps_done) / self.global_batch_size

    def ramp_steps(self) -> int:
        """Optimizer steps until the batch reaches `global_batch_size`."""
        steps = 0
        while self.batch_at(steps + 1) != self.global_batch_size:
            steps += 1
        return steps

    def describe(self) -> str:
        return (
            f"{_K}: global batch {self.start} -> {self.global_batch_size} in steps of "
            f"{self.increment} over {self.ramp_samples} samples ({self.ramp_steps()} optimizer steps; "
            f"the learning-rate schedule counts samples / {self.global_batch_size})"
        )


def check_ramp(start: int, increment: int, global_batch_size: int) -> None:
    """The rules that need no data-parallel size (Megatron asserts the same).

    Raises:
        ValueError: naming `training.rampup_batch_size`.
    """
    if start > global_batch_size:
        raise ValueError(
            f"{_K}: the start batch {start} is larger than training.global_batch_size ({global_batch_size})"
        )
    if (global_batch_size - start) % increment:
        raise ValueError(
            f"{_K}: training.global_batch_size - start ({global_batch_size} - {start}) is not a "
            f"multiple of the increment {increment}"
        )


def build_rampup(
    ramp: list[int] | tuple[int, ...] | None,
    *,
    global_batch_size: int,
    micro_samples: int,
    pipeline_parallel: int,
    epochs: bool,
) -> BatchRampUp | None:
    """`training.rampup_batch_size` for `micro_samples` rows per micro-batch (None: no ramp).

    Raises:
        NotImplementedError: with pipeline parallelism or `training.epochs` (not built yet).
    """
    if ramp is None:
        return None
    for on, what in (
        (pipeline_parallel > 1, "parallelism.pipeline_parallel > 1"),
        (epochs, "training.epochs"),
    ):
        if on:
            raise NotImplementedError(f"not supported yet: training.rampup_batch_size with {what}")
    return BatchRampUp(
        start=int(ramp[0]),
        increment=int(ramp[1]),
        ramp_samples=int(ramp[2]),
        global_batch_size=global_batch_size,
        micro_samples=micro_samples,
    )
