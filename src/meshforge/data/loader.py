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

Evaluation. `EvalLoader` reads a dataset once, in order, sharded the same way (chunk c to rank
`c % dp_size`); every rank yields the same number of full-size batches, the last chunks padded with
rows whose labels are all -100 (they add no loss and no tokens), so collectives stay in step. Each
`iter(loader)` starts from the first sample again.

Streams. `StreamLoader` serves rows of an iterable of unknown length (SFT `streaming: true`) with
the same round-robin sharding and epoch rules; its resume position is a row count that is skipped by
re-reading the stream (see its docstring).

Datasets plug in through the small `SampleSource` protocol below (`len` and `get_batch`); the loader
turns their numpy arrays into CPU `torch.long` tensors (the batch contract of DESIGN.md: `input_ids`,
`labels` already shifted with -100 for no loss, optional `position_ids` and `segment_ids`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import numpy as np
import torch

if TYPE_CHECKING:
    from meshforge.data.config import TrainDatasetConfig
    from meshforge.data.context import LoaderContext

R = TypeVar("R")  # one row of a stream, as its `collate` takes it

# row_index ([B]): each row's index in the precomputed reference table (train/reference_table.py).
BATCH_KEYS = ("input_ids", "labels", "position_ids", "segment_ids", "row_index")
IGNORE_INDEX = -100


class SampleSource(Protocol):
    """What a dataset provides to the loader."""

    def __len__(self) -> int: ...

    def get_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Samples `indices` as integer arrays [B, S]; keys from BATCH_KEYS, with input_ids and labels."""
        ...


def to_tensors(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """A dataset batch (integer arrays) as CPU `torch.long` tensors, its keys checked."""
    missing = {"input_ids", "labels"} - arrays.keys()
    unknown = arrays.keys() - set(BATCH_KEYS)
    if missing or unknown:
        raise KeyError(
            f"dataset batch keys {sorted(arrays)}: missing {sorted(missing)}, unknown {sorted(unknown)}"
        )
    return {
        key: torch.from_numpy(np.ascontiguousarray(value, dtype=np.int64)) for key, value in arrays.items()
    }


def check_layout(local_batch_size: int, dp_rank: int, dp_size: int, global_batch_size: int | None) -> int:
    """Validate the batch layout; returns the epoch rounding unit (global batch, else one round)."""
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
    return unit


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

    @classmethod
    def for_run(cls, dataset: SampleSource, ctx: LoaderContext, data: TrainDatasetConfig) -> StatefulLoader:
        """This rank's loader over `dataset`, laid out by the run's context and `train_dataset` section."""
        return cls(
            dataset,
            local_batch_size=ctx.local_batch_size,
            dp_rank=ctx.dp_rank,
            dp_size=ctx.dp_size,
            seed=ctx.seed,
            shuffle=data.dataloader.shuffle,
            drop_remainder=data.drop_remainder,
            global_batch_size=ctx.global_batch_size,
        )

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
        unit = check_layout(local_batch_size, dp_rank, dp_size, global_batch_size)
        round_size = dp_size * local_batch_size
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
        # Optimizer steps the data was sized for, when the builder decided them (training.epochs).
        self.total_steps: int | None = None

    @property
    def num_samples(self) -> int:
        """Samples in one epoch of the dataset (before `drop_remainder`)."""
        return self.samples_per_epoch

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
        return to_tensors(arrays)

    def state_dict(self) -> dict[str, int]:
        """Small JSON-able position; the same on every rank."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "samples_per_epoch": self.samples_per_epoch,
            "used_per_epoch": self.used_per_epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue exactly where `state` was taken, without reading the skipped data.

        Raises:
            ValueError: the data, seed or epoch rounding changed, so the position would mean other samples.
        """
        if state.get("stream"):
            raise ValueError("data loader state was saved by a streaming loader; streaming changed")
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


class EvalLoader:
    """One ordered pass over an evaluation dataset, sharded over data-parallel ranks, restartable.

    Every `iter(loader)` (a `for` loop) starts at the first sample again, so the trainer calls
    `for batch in loader:` at each evaluation. Samples are read in order 0..N-1 (never shuffled) in
    chunks of `local_batch_size`, chunk c going to rank `c % dp_size`. All ranks yield
    `num_batches = ceil(N / (dp_size * local_batch_size))` batches of `local_batch_size` rows; rows
    past the end of the data are copies of sample 0 with every label -100, so no sample is dropped,
    none is counted twice, and FSDP's collectives see the same number of forwards on every rank.

    Args:
        dataset: the sample source (`len` and `get_batch`).
        local_batch_size: rows per batch on this rank.
        dp_rank, dp_size: position on the data-parallel ("batch") mesh axis.
    """

    def __init__(self, dataset: SampleSource, *, local_batch_size: int, dp_rank: int, dp_size: int):
        check_layout(local_batch_size, dp_rank, dp_size, None)
        if len(dataset) == 0:
            raise ValueError("the evaluation data has no samples")
        self.dataset = dataset
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.num_samples = len(dataset)
        self.num_batches = math.ceil(self.num_samples / (dp_size * local_batch_size))

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        round_size = self.dp_size * self.local_batch_size
        for k in range(self.num_batches):
            first = k * round_size + self.dp_rank * self.local_batch_size
            indices = np.arange(first, first + self.local_batch_size, dtype=np.int64)
            real = indices < self.num_samples
            arrays = self.dataset.get_batch(np.where(real, indices, 0))
            if not real.all():
                labels = np.array(arrays["labels"], dtype=np.int64, copy=True)
                labels[~real] = IGNORE_INDEX
                arrays = {**arrays, "labels": labels}
            yield to_tensors(arrays)


class StreamLoader(Generic[R]):
    """Infinite, DP-sharded micro-batches from a row stream of unknown length, resumable exactly.

    `rows(epoch)` gives a fresh iterator over one epoch of rows (the stream reshuffles per epoch);
    `collate(rows)` turns a list of rows into integer arrays (keys of BATCH_KEYS). Rows are read a
    *unit* at a time (the global batch when known, else one round of `dp_size * local_batch_size`)
    and dealt out as `StatefulLoader` does: chunk c of the unit to rank `c % dp_size`. Every rank
    reads (and so processes) the whole stream and keeps its own chunks.

    Epochs: with `drop_remainder` a unit never spans two epochs (an epoch's last `rows mod unit`
    rows are dropped; an epoch with fewer rows than one unit is an error); without it the epochs are
    concatenated. The state is the stream position where the current unit starts (epoch and rows of
    that epoch before it) plus the rounds of the unit already served. Resuming re-opens that epoch's
    stream and skips the rows before the position by reading (and processing) them again: the cost
    of a resume grows with the position in the epoch, unlike `StatefulLoader`'s O(1) jump.

    Args:
        rows: epoch -> iterator of rows.
        collate: list of rows -> batch arrays.
        local_batch_size, dp_rank, dp_size, global_batch_size, drop_remainder: as `StatefulLoader`.
        seed: the stream's seed, recorded in the state so that a resume with another seed is refused.
    """

    num_samples: int | None = None  # unknown: a stream has no length before it is read

    def __init__(
        self,
        rows: Callable[[int], Iterable[R]],
        collate: Callable[[list[R]], dict[str, np.ndarray]],
        *,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        drop_remainder: bool = True,
        global_batch_size: int | None = None,
    ):
        self._unit = check_layout(local_batch_size, dp_rank, dp_size, global_batch_size)
        self._rows = rows
        self._collate = collate
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.drop_remainder = drop_remainder
        self.total_steps: int | None = None
        self._round = dp_size * local_batch_size
        self._start = (0, 0)  # (epoch, rows of that epoch before the current unit)
        self._rounds_done = 0  # rounds of the current unit already served
        self._unit_rows: list[R] | None = None
        self._iter: Iterator[R] | None = None
        self._cursor = (0, 0)  # (epoch, rows read) of the open iterator
        self.dropped_rows = 0  # rows left out at epoch ends so far (drop_remainder)

    @property
    def epoch(self) -> int:
        """Epoch (0-based) where the current unit starts."""
        return self._start[0]

    @property
    def position(self) -> int:
        """Rows of that epoch read before the current unit."""
        return self._start[1]

    def _open(self, epoch: int, position: int) -> None:
        it = iter(self._rows(epoch))
        skipped = sum(1 for _ in itertools.islice(it, position))
        if skipped < position:
            raise ValueError(
                f"data loader state: epoch {epoch} of the stream has {skipped} rows, fewer than the "
                f"saved position {position} (the data or its options changed)"
            )
        self._iter, self._cursor = it, (epoch, position)

    def _fill(self) -> None:
        if self._iter is None or self._cursor != self._start:
            self._open(*self._start)
        rows: list[R] = []
        while len(rows) < self._unit:
            try:
                row = next(self._iter)  # type: ignore[arg-type]
            except StopIteration:
                epoch, read = self._cursor
                if read == 0:
                    raise ValueError(f"epoch {epoch} of the data stream has no rows") from None
                if self.drop_remainder:
                    if self._start == (epoch, 0):
                        raise ValueError(
                            f"the data stream has {read} rows per epoch, fewer than one global batch "
                            f"({self._unit}); add data or lower the batch size"
                        ) from None
                    self.dropped_rows += len(rows)
                    rows = []
                    self._start = (epoch + 1, 0)
                self._open(epoch + 1, 0)
                continue
            rows.append(row)
            self._cursor = (self._cursor[0], self._cursor[1] + 1)
        self._unit_rows = rows

    def __iter__(self) -> StreamLoader[R]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._unit_rows is None:
            self._fill()
        assert self._unit_rows is not None
        first = self._rounds_done * self._round + self.dp_rank * self.local_batch_size
        chunk = self._unit_rows[first : first + self.local_batch_size]
        self._rounds_done += 1
        if self._rounds_done * self._round == self._unit:
            self._start, self._rounds_done, self._unit_rows = self._cursor, 0, None
        return to_tensors(self._collate(chunk))

    def state_dict(self) -> dict[str, int]:
        """Small JSON-able position; the same on every rank."""
        return {
            "stream": True,
            "epoch": self._start[0],
            "position": self._start[1],
            "rounds": self._rounds_done,
            "unit": self._unit,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where `state` was taken; the skipped rows are re-read on the next batch.

        Raises:
            ValueError: a state of another loader kind, seed or global batch.
        """
        if not state.get("stream"):
            raise ValueError("data loader state was saved by a non-streaming loader; streaming changed")
        for key, mine in (("seed", self.seed), ("unit", self._unit)):
            if state.get(key) != mine:
                raise ValueError(
                    f"data loader state does not match this run: {key} was {state.get(key)!r}, now {mine!r}"
                )
        rounds = int(state["rounds"])
        if not 0 <= rounds < self._unit // self._round:
            raise ValueError(f"data loader state out of range: rounds={rounds}")
        self._start = (int(state["epoch"]), int(state["position"]))
        self._rounds_done = rounds
        self._unit_rows = None
