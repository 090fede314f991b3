"""Run length by epochs: how many optimizer steps `training.epochs` passes over the data take.

Shared by `data/build.py` (loaders whose length is their dataset's) and the Megatron loader (which
sizes its dataset by the steps), so neither imports the other.
"""

from __future__ import annotations

import math


def steps_for_epochs(num_samples: int, epochs: float, global_batch_size: int, drop_remainder: bool) -> int:
    """Optimizer steps of `epochs` passes over `num_samples` samples, `global_batch_size` per step.

    With `drop_remainder` an epoch is `num_samples // global_batch_size` steps (the loader never
    lets a step span two epochs) and the run `ceil(epochs * that)` steps, as Hugging Face's Trainer
    counts `num_train_epochs`; without it the epochs are read back to back, `ceil(epochs *
    num_samples / global_batch_size)` steps.

    Raises:
        ValueError: no whole step (the data is smaller than one global batch, or epochs too small).
    """
    if num_samples <= 0 or global_batch_size <= 0 or epochs <= 0:
        raise ValueError(
            f"training.epochs: need positive samples, batch and epochs, got {num_samples}, "
            f"{global_batch_size}, {epochs}"
        )
    if drop_remainder:
        per_epoch = num_samples // global_batch_size
        if per_epoch == 0:
            raise ValueError(
                f"training.epochs: the data has {num_samples} samples, fewer than one global batch "
                f"({global_batch_size}); add data or lower training.global_batch_size"
            )
        # Rounded first so that e.g. 0.1 * 30 (3.0000000000000004) gives 3 steps, not 4.
        return max(1, math.ceil(round(epochs * per_epoch, 6)))
    return max(1, math.ceil(round(epochs * num_samples / global_batch_size, 6)))
