"""`training.pref_ref_logps: precompute`: the table of reference log-probabilities and its lookup.

A reference-based preference loss (sigmoid, hinge, ipo) compares the policy with a frozen
reference whose log-probabilities never change: one pass over the data before step 1
(`train/reference_pass.py`) gives every pair's chosen and rejected sums, and the steps read them
from this table instead of running a reference forward (no second copy of the weights during
training, one forward less per step).

Keys. The table is indexed by the row's place in its dataset: the train rows first, then each
validation part in the run's order (`[rows, pairs per row, 2]`, float32 sums, on the run's device:
8 bytes a pair). The loaders' datasets are wrapped in `IndexedRows`, so each batch carries
`row_index` ([rows], int64): the lookup follows the sample order whatever the shuffle, the resume
position or the number of data ranks. The answers' token counts (for the length-averaged losses)
and the empty pair slots come from the batch itself, as `sequence_logps` derives them, so a
looked-up reference equals the forward's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from meshforge.loss.preference import PairLogps
from meshforge.loss.sequence_logps import sequence_layout

Batch = dict[str, torch.Tensor]
ROW_INDEX = "row_index"  # the batch key: each row's index in the table


class IndexedRows:
    """A pair-row dataset whose batches also carry each row's table index (`offset + index`)."""

    def __init__(self, dataset: Any, offset: int):
        self.dataset = dataset
        self.offset = offset

    def __len__(self) -> int:
        return len(self.dataset)

    def get_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        arrays = dict(self.dataset.get_batch(indices))
        arrays[ROW_INDEX] = np.asarray(indices, dtype=np.int64) + self.offset
        return arrays


class ReferenceTable:
    """The reference sums of every pair of the run's data, filled once by `precompute_reference`."""

    def __init__(self) -> None:
        self.values: torch.Tensor | None = None  # [rows, pairs per row, 2] on the run's device

    def lookup(self, batch: Batch) -> PairLogps:
        """The reference `PairLogps` of a pair batch, as `PreferenceStep._pair_logps` returns them.

        Raises:
            RuntimeError: the table was not computed yet, or a batch without `row_index`.
        """
        if self.values is None or ROW_INDEX not in batch:
            raise RuntimeError(
                "training.pref_ref_logps: precompute: the reference table is not built (or the batch "
                "does not come from the run's indexed loaders)"
            )
        labels, segments = batch["labels"], batch["segment_ids"]
        layout = sequence_layout(labels, segments)
        slots = layout.num_keys // labels.shape[0]
        counts, present = layout.counts.view(-1, 2), layout.present
        pairs = slots // 2
        if pairs > self.values.shape[1]:
            raise RuntimeError(f"a row holds {pairs} pairs; the reference table has {self.values.shape[1]}")
        sums = self.values[batch[ROW_INDEX].to(self.values.device)][:, :pairs].reshape(-1, 2)
        # A sequence without a counted label sums to 0, an empty slot gets the -1 stand-in: as the forward.
        sums = torch.where(counts > 0, sums, torch.zeros_like(sums))
        sums = torch.where(present[:, None], sums, torch.full_like(sums, -1.0))
        return PairLogps(sums[:, 0], sums[:, 1], counts[:, 0], counts[:, 1])
