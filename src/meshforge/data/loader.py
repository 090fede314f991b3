"""The stateful, data-parallel-sharded micro-batch loader every training dataset is read through.

Order. Each epoch has one global sample order: `numpy.random.default_rng([seed, epoch]).permutation`
when shuffling, else 0, 1, 2, ... That order is read as one stream in chunks of `local_batch_size`
samples, chunk c going to data-parallel rank `c % dp_size`; one call to `next()` on every rank
consumes one *round* of `dp_size` chunks. So the samples of a step (gradient accumulation included)
are the same consecutive stretch of the order whatever `dp_size` is, as long as the global batch is
the same: a 2-process run sees exactly the samples of a 1-process run, which is what makes their
losses equal. Nothing depends on the number of training steps; the loader is infinite.

Epochs. With `drop_remainder` (the default) an epoch uses `floor(N / U) * U` of its N samples, where
U is the global batch size when known (else one round, `dp_size * local_batch_size`), so a step
never mixes two epochs; the `N mod U` samples at the end of each epoch's order are not used in that
epoch (with shuffling, different ones each epoch) and are reported as `dropped_per_epoch`. Without
it the epochs' orders are simply concatenated: nothing is dropped and one step may span two epochs.

Resume. The state is the pair (epoch, samples of that epoch already consumed by all ranks together),
identical on every rank. `load_state_dict` jumps there in O(1) (one permutation is drawn for the new
epoch, no data is read), and positions are global sample counts, so a resume with another
`dp_size * local_batch_size` that divides the same global batch continues the same order.

Datasets plug in through the small `SampleSource` protocol below (`len` and `get_batch`); the loader
turns their numpy arrays into CPU `torch.long` tensors (the batch contract of DESIGN.md: `input_ids`,
`labels` already shifted with -100 for no loss, optional `position_ids` and `segment_ids`).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

BATCH_KEYS = ("input_ids", "labels", "position_ids", "segment_ids")


class SampleSource(Protocol):
    """What a dataset provides to the loader."""

    def __len__(self) -> int: ...

    def get_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Samples `indices` as integer arrays [B, S]; keys from BATCH_KEYS, with input_ids and labels."""
        ...


class StatefulLoader:
    """Infinite iterator of this rank's micro-batches, with an exact, O(1) resumable position.

    Args:
        dataset: the sample source.
        local_batch_size: samples per micro-batch on this rank.
        dp_rank, dp_size: this rank's index on the data-parallel ("batch") mesh axis and its size.
        seed: shuffle seed; the order depends only on (seed, epoch).
        shuffle: permute each epoch; else read samples in order.
        drop_remainder: see the module docstring.
        global_batch_size: samples per optimizer step over all ranks; the epoch length is rounded
            down to a multiple of it (when dropping the remainder) so steps never straddle epochs.
            Must be a multiple of `dp_size * local_batch_size`. None means one round.
    """

    def __init__(
        self,
        dataset: SampleSource,
        *,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool,
        drop_remainder: bool = True,
        global_batch_size: int | None = None,
    ):
        if local_batch_size <= 0:
            raise ValueError(f"local_batch_size must be positive, got {local_batch_size}")
        if dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size), got dp_rank={dp_rank}, dp_size={dp_size}")
        round_size = dp_size * local_batch_size
        unit = round_size if global_batch_size is None else global_batch_size
        if unit <= 0 or unit % round_size:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be a positive multiple of "
                f"dp_size * local_batch_size = {dp_size} * {local_batch_size}"
            )
        self.dataset = dataset
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_remainder = drop_remainder
        self.samples_per_epoch = len(dataset)
        used = (self.samples_per_epoch // unit) * unit if drop_remainder else self.samples_per_epoch
        if used == 0:
            raise ValueError(
                f"the dataset has {self.samples_per_epoch} samples, fewer than one "
                f"{'global batch' if global_batch_size else 'round of dp_size * local_batch_size'} "
                f"({unit}); add data or lower the batch size"
            )
        self.used_per_epoch = used
        self.dropped_per_epoch = self.samples_per_epoch - used
        self._round_size = round_size
        self._epoch = 0
        self._position = 0  # samples of this epoch consumed by all ranks together
        self._order_epoch = -1
        self._order = np.zeros(0, dtype=np.int64)

    @property
    def epoch(self) -> int:
        """Epoch (0-based) of the next sample to be read."""
        return self._epoch

    @property
    def position(self) -> int:
        """Samples of the current epoch already consumed by all ranks together."""
        return self._position

    def _epoch_order(self, epoch: int) -> np.ndarray:
        # Only the current epoch's order is kept: one permutation in memory, redrawn at rollover.
        if epoch != self._order_epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch])
                self._order = rng.permutation(self.samples_per_epoch).astype(np.int64)
            else:
                self._order = np.arange(self.samples_per_epoch, dtype=np.int64)
            self._order_epoch = epoch
        return self._order

    def _take(self, epoch: int, start: int, count: int) -> np.ndarray:
        """`count` sample indices of the global stream from (epoch, start), crossing epochs if needed."""
        pieces = []
        while count > 0:
            order = self._epoch_order(epoch)
            piece = order[start : min(start + count, self.used_per_epoch)]
            pieces.append(piece)
            count -= len(piece)
            epoch, start = epoch + 1, 0
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def __iter__(self) -> StatefulLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        # This rank's chunk of the round starts dp_rank chunks into it; without drop_remainder it
        # may start in, or run into, the next epoch.
        offset = self._position + self.dp_rank * self.local_batch_size
        epoch = self._epoch + offset // self.used_per_epoch
        indices = self._take(epoch, offset % self.used_per_epoch, self.local_batch_size)
        self._position += self._round_size
        while self._position >= self.used_per_epoch:
            self._position -= self.used_per_epoch
            self._epoch += 1
        return self._to_tensors(self.dataset.get_batch(indices))

    @staticmethod
    def _to_tensors(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        missing = {"input_ids", "labels"} - arrays.keys()
        unknown = arrays.keys() - set(BATCH_KEYS)
        if missing or unknown:
            raise KeyError(
                f"dataset batch keys {sorted(arrays)}: missing {sorted(missing)}, unknown {sorted(unknown)}"
            )
        return {
            key: torch.from_numpy(np.ascontiguousarray(value, dtype=np.int64))
            for key, value in arrays.items()
        }

    def state_dict(self) -> dict[str, Any]:
        """Small JSON-able position; the same on every rank."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "samples_per_epoch": self.samples_per_epoch,
            "used_per_epoch": self.used_per_epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was taken, without reading the skipped data.

        Raises:
            ValueError: the data, seed or epoch rounding changed, so the position would mean other samples.
        """
        for key in ("samples_per_epoch", "used_per_epoch", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"data loader state does not match this run: {key} was {state[key]!r}, now "
                    f"{getattr(self, key)!r} (same data, seed, shuffle and global batch are needed to resume)"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.used_per_epoch:
            raise ValueError(f"data loader state out of range: epoch={epoch}, position={position}")
        self._epoch, self._position = epoch, position
