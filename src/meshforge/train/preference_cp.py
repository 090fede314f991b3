"""Preference pairs under context parallelism: each CP rank holds a slice of every pair row.

The trainer shards a pair row like any row (`shard_batch_for_cp`: the method's token layout,
load-balanced for the ring methods, position ids restarting per segment computed from the whole
row first), so a sequence's tokens are spread over the CP ranks. What a sequence's log-probability
needs from the whole row (which labels stay inside their segment, how many tokens each sequence
and pair slot has) is computed from the row's labels and segment ids gathered over the CP group
(two small integer all-gathers), and each rank sums the log-probabilities of the positions it
holds (`sequence_layout`'s `local_index`).

The partial sums are then summed over the CP group by `_SumOverRanks`, whose backward passes each
rank's gradient through unchanged: every CP rank computes the same pair losses from the same
sums, and each backpropagates `d loss / d sum` into its own tokens only, so the gradients summed
over the CP ranks (FSDP's reduction over the `loss` mesh, which holds them) are one process's.
The pair count, the reported loss sum and the metric sums are taken on CP rank 0 only (`owner`),
so their sums over the `loss` mesh count each pair once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from meshforge.loss.sequence_logps import SequenceLayout, pairs_in_rows, sequence_layout
from meshforge.parallel.context import local_token_index, shard_batch_for_cp

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

Batch = dict[str, torch.Tensor]


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward; the gradient passes through unchanged (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


@dataclass(frozen=True)
class CPPairs:
    """The CP side of a preference step: whole-row layouts, the sum over ranks, the owner rank.

    Attributes:
        mesh: the 1-D `cp` mesh.
        method: `parallelism.cp_method()` (decides which tokens a rank holds).
    """

    mesh: DeviceMesh
    method: str

    @property
    def owner(self) -> bool:
        """Whether this rank counts the pairs, losses and metrics of its CP group (CP rank 0)."""
        return self.mesh.get_local_rank() == 0

    def shard(self, batch: Batch) -> Batch:
        """This rank's slice of a whole batch (what the trainer does to a training batch)."""
        return shard_batch_for_cp(batch, self.mesh, method=self.method)

    def _index(self, seq_len: int, device: torch.device) -> torch.Tensor:
        cp = self.mesh.size()
        return local_token_index(seq_len, cp, self.mesh.get_local_rank(), method=self.method).to(device)

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """The whole rows of a `[rows, S / cp]` integer slice, in global order (no gradient)."""
        cp, local = self.mesh.size(), x.shape[1]
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=self.mesh.get_group())
        gathered = torch.cat(parts, dim=1)
        order = torch.cat([local_token_index(local * cp, cp, r, method=self.method) for r in range(cp)])
        return gathered.index_select(1, torch.argsort(order).to(x.device))

    def count_pairs(self, batch: Batch) -> torch.Tensor:
        """The pairs of the CP group's rows on its owner rank, 0 on the others."""
        pairs = pairs_in_rows(self.whole(batch["labels"]), self.whole(batch["segment_ids"]))
        return pairs if self.owner else torch.zeros_like(pairs)

    def layout(self, batch: Batch) -> SequenceLayout:
        """The counted positions of this rank's slice, from the whole rows' labels and segments."""
        labels, segments = self.whole(batch["labels"]), self.whole(batch["segment_ids"])
        return sequence_layout(labels, segments, self._index(labels.shape[1], labels.device))

    def reduce(self, sums: torch.Tensor) -> torch.Tensor:
        """Every sequence's whole sum from this rank's partial ones (gradient passed through)."""
        out = _SumOverRanks.apply(sums, self.mesh.get_group())
        assert isinstance(out, torch.Tensor)
        return out
