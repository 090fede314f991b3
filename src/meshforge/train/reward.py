"""The step of `training.stage: rm`: a reward model trained on preference pairs.

The rows are DPO's pair rows (`data/sft/pairwise.py`: chosen = segment 1, rejected = segment 2),
so one forward of the base model gives both sequences' final hidden states; the value head
(`train/reward_head.py`) reads each sequence's last token (`loss/reward.py`). The LM head is
never applied. The trainer calls this object where it calls DPO's `PreferenceStep`
(`Run.preference`): it counts pairs instead of tokens (`count_pairs`), so
`sum(pair losses) / normalizer`, summed over micro-batches and ranks, is the gradient of the
mean over the global batch's pairs, and the metrics are summed per pair and reduced once over
the `loss` mesh at the step's end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from meshforge.loss.reward import METRIC_KEYS, pair_rewards, pairwise_loss
from meshforge.train.preference import eval_means
from meshforge.train.reward_head import value_head
from meshforge.utils import distributed as dist_utils

if TYPE_CHECKING:
    import torch.distributed as dist

Batch = dict[str, torch.Tensor]


@dataclass
class RewardStep:
    """The trainer's forward and backward for reward-model pairs, and the step's metric sums.

    Attributes:
        autocast: the forward runs under autocast to `compute_dtype` (as the trainer's does).
        aux_coef: weight of the MoE router loss (0: none), each micro-batch's weighted by its
            share of the step's pairs, as DPO does.
    """

    compute_dtype: torch.dtype
    autocast: bool
    device: torch.device
    aux_coef: float = 0.0
    _sums: torch.Tensor | None = field(default=None, repr=False)
    _eval_sums: torch.Tensor | None = field(default=None, repr=False)

    @staticmethod
    def count_pairs(batch: Batch) -> torch.Tensor:
        """Pairs in a micro-batch: each row's last rejected segment id is twice its pairs."""
        return (batch["segment_ids"].amax(dim=1) // 2).sum()

    def rewards(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """`(rewards [P, 2], present [P])` of the batch's pair slots (`loss/reward.py`)."""
        inputs = {k: batch[k] for k in ("position_ids", "segment_ids") if k in batch}
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.autocast):
            hidden = model(batch["input_ids"], return_hidden=True, **inputs)
            # Read after the forward: under FSDP the root keeps its parameters unsharded until backward.
            rewards, present = pair_rewards(hidden, batch["segment_ids"], value_head(model).weight)
        # Empty slots (rows with fewer pairs, padding rows) get a zero stand-in reward.
        return torch.where(present[:, None], rewards, torch.zeros_like(rewards)), present

    def forward_backward(self, model: nn.Module, batch: Batch, normalizer: torch.Tensor) -> torch.Tensor:
        """Forward, backward of this micro-batch's share of the step's mean pair loss; its loss sum."""
        rewards, present = self.rewards(model, batch)
        losses, metrics = pairwise_loss(rewards)
        loss_sum = torch.where(present, losses, torch.zeros_like(losses)).sum()
        objective = loss_sum / normalizer
        used = present.to(losses.dtype)
        aux_share = torch.zeros((), dtype=losses.dtype, device=losses.device)
        if self.aux_coef:
            router_loss = cast(Callable[[], torch.Tensor | None], model.aux_loss)()
            if router_loss is not None:
                aux_share = router_loss.float() * (used.sum() / normalizer)
                objective = objective + self.aux_coef * aux_share
        objective.backward()
        sums = torch.stack(
            [used.sum(), aux_share.detach(), *((metrics[k] * used).sum() for k in METRIC_KEYS)]
        )
        self._sums = sums if self._sums is None else self._sums + sums
        return loss_sum.detach()

    def eval_forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """A validation batch (no gradient): its pair loss sum and pair count; keeps its metric sums."""
        with torch.no_grad():
            rewards, present = self.rewards(model, batch)
            losses, metrics = pairwise_loss(rewards)
        used = present.to(losses.dtype)
        sums = torch.stack([used.sum(), *((metrics[k] * used).sum() for k in METRIC_KEYS)])
        self._eval_sums = sums if self._eval_sums is None else self._eval_sums + sums
        return torch.where(present, losses, torch.zeros_like(losses)).sum(), present.sum()

    def eval_metrics(self, group: dist.ProcessGroup | None) -> dict[str, float]:
        """`eval_<metric>` over the evaluation's pairs (one all-reduce); resets the sums."""
        sums, self._eval_sums = self._eval_sums, None
        return eval_means(sums, METRIC_KEYS, group)

    def step_metrics(self, group: dist.ProcessGroup | None) -> dict[str, float | int]:
        """The step's mean metrics over its global pairs (one all-reduce); resets the sums."""
        if self._sums is None:
            return {}
        total = dist_utils.all_reduce_sum(self._sums, group).tolist()
        self._sums = None
        pairs = max(total[0], 1.0)
        means = {k: v / pairs for k, v in zip(METRIC_KEYS, total[2:], strict=True)}
        return {"pairs": int(total[0]), **({"aux_loss": total[1]} if self.aux_coef else {}), **means}
