"""The preference step of `training.stage: dpo`: policy and reference log-probabilities, loss, metrics.

Each micro-batch row is one pair (`data/sft/pairwise.py`: chosen = segment 1, rejected =
segment 2), so one forward gives both answers' summed log-probabilities
(`loss/sequence_logps.py`, through the head chunk by chunk when the run's loss takes hidden
states). The reference model, for the losses that have one:
* with LoRA, the policy itself with its adapters off (`lora.layer.adapters_disabled`): no second
  copy of the weights, one more forward without gradients;
* with full fine-tuning, a frozen copy built by the same `build_model` as the policy (the same
  source or seeded init, the same parallelisation and FSDP sharding), in eval mode;
* with `training.pref_ref_logps: precompute`, a table of both answers' sums per pair, computed
  once before step 1 (`train/reference_table.py`): no reference forward and no copy in training.

Arithmetic: the trainer counts pairs instead of valid tokens (`count_pairs`), so the normalizer
it passes is the number of pairs in the global batch and `sum(pair losses) / normalizer`,
summed over micro-batches and ranks, is the gradient of the global-batch mean, as the token
mean is for SFT. The metrics (`loss/preference.py`'s `METRIC_KEYS`) are summed per pair over the
step and reduced once over the `loss` mesh at its end (`step_metrics`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from meshforge.loss.preference import METRIC_KEYS, PairLogps, PreferenceLoss
from meshforge.loss.sequence_logps import pairs_in_rows, sequence_logps
from meshforge.utils import distributed as dist_utils

if TYPE_CHECKING:
    import torch.distributed as dist

    from meshforge.train.preference_cp import CPPairs
    from meshforge.train.reference_table import ReferenceTable

Batch = dict[str, torch.Tensor]
ORPO_KEYS = ("sft_loss", "odds_ratio_loss")  # the extra metrics of the orpo loss


@dataclass
class PreferenceStep:
    """The trainer's forward and backward for preference pairs, and the step's metric sums.

    Attributes:
        loss: the objective (`training.pref_loss` and its coefficients).
        lora: reference = the policy with adapters off (LoRA runs).
        reference: the frozen reference copy (full fine-tuning), else None.
        chunk_size: the head's tokens per chunk when the model returns hidden states; None: logits.
        autocast: the forward runs under autocast to `compute_dtype` (as the trainer's does).
        aux_coef: weight of the MoE router loss of the policy forward (0: none), added as the
            trainer adds it to the LM loss: each micro-batch's router loss (a mean) weighted by
            its share of the step's pairs, so one micro-batch on one rank gives `loss + coef * aux`.
        cp: under context parallelism, the whole-row side of the sums (`train/preference_cp.py`).
        over_groups: with torchft replica groups, the sum over the live groups (`train/replicas.py`)
            of the step's metric sums, after their sum over the group's `loss` mesh.
    """

    loss: PreferenceLoss
    lora: bool
    reference: nn.Module | None
    chunk_size: int | None
    compute_dtype: torch.dtype
    autocast: bool
    device: torch.device
    keys: tuple[str, ...] = METRIC_KEYS
    aux_coef: float = 0.0
    table: ReferenceTable | None = None  # precomputed reference sums (train/reference_table.py)
    cp: CPPairs | None = None
    over_groups: Callable[[torch.Tensor], torch.Tensor] | None = None
    _sums: torch.Tensor | None = field(default=None, repr=False)
    _eval_sums: torch.Tensor | None = field(default=None, repr=False)

    def count_pairs(self, batch: Batch) -> torch.Tensor:
        """Pairs in a micro-batch: each row's last rejected segment id is twice its pairs (rows with labels)."""
        if self.cp is not None:
            return self.cp.count_pairs(batch)
        return pairs_in_rows(batch["labels"], batch["segment_ids"])

    def _pair_logps(self, model: nn.Module, batch: Batch) -> tuple[PairLogps, torch.Tensor]:
        """The pair slots' log-probabilities and which slots hold a pair (`sequence_logps`)."""
        inputs = {k: batch[k] for k in ("position_ids", "segment_ids") if k in batch}
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.autocast):
            if self.chunk_size is not None:
                hidden = model(batch["input_ids"], return_hidden=True, **inputs)
                # Read after the forward: under FSDP the root keeps lm_head unsharded until backward.
                return self.logps_of(hidden, batch, cast(nn.Linear, model.lm_head).weight)
            return self.logps_of(model(batch["input_ids"], **inputs), batch)

    def logps_of(
        self, output: torch.Tensor, batch: Batch, head_weight: torch.Tensor | None = None
    ) -> tuple[PairLogps, torch.Tensor]:
        """`_pair_logps` from the model's output: logits, or hidden states with `head_weight`."""
        layout = self.cp.layout(batch) if self.cp is not None else None
        sums, counts, present = sequence_logps(
            output,
            batch["labels"],
            batch["segment_ids"],
            head_weight=head_weight,
            chunk_size=self.chunk_size if head_weight is not None else None,
            layout=layout,
        )
        if self.cp is not None:
            sums = self.cp.reduce(sums)
        # Empty slots (rows with fewer pairs, padding rows) get a finite stand-in log-probability,
        # so that no loss (ORPO's log(1 - p) at p = 1) turns them into a NaN that masking keeps.
        sums = torch.where(present[:, None], sums, torch.full_like(sums, -1.0))
        return PairLogps(sums[:, 0], sums[:, 1], counts[:, 0], counts[:, 1]), present

    def reference_logps(self, model: nn.Module, batch: Batch) -> PairLogps | None:
        """The reference model's pair log-probabilities (no gradient), or None without a reference."""
        if not self.loss.needs_reference:
            return None
        if self.table is not None:  # training.pref_ref_logps: precompute
            return self.table.lookup(batch)
        return self.reference_forward(model, batch)

    def reference_forward(self, model: nn.Module, batch: Batch) -> PairLogps:
        """The reference forward: the frozen copy, or the policy (`model`) with its adapters off."""
        with torch.no_grad():
            if self.reference is not None:
                return self._pair_logps(self.reference, batch)[0]
            from meshforge.lora.layer import adapters_disabled

            with adapters_disabled(model) if self.lora else contextlib.nullcontext():
                return self._pair_logps(model, batch)[0]

    def forward_backward(self, model: nn.Module, batch: Batch, normalizer: torch.Tensor) -> torch.Tensor:
        """Reference, then policy forward; backward of this micro-batch's share; its loss sum."""
        reference = self.reference_logps(model, batch)
        policy, present = self._pair_logps(model, batch)
        router_loss = None
        if self.aux_coef:
            # The router loss of the last forward: the policy's (the reference ran first).
            router_loss = cast(Callable[[], torch.Tensor | None], model.aux_loss)()
        objective, loss_sum, sums = self.pair_loss(policy, present, reference, normalizer, router_loss)
        objective.backward()
        self.keep(sums)
        return loss_sum

    def pair_loss(
        self,
        policy: PairLogps,
        present: torch.Tensor,
        reference: PairLogps | None,
        normalizer: torch.Tensor,
        router_loss: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One micro-batch's objective (to backpropagate), its reported loss sum and its metric sums.

        `router_loss`: the policy forward's MoE router loss, weighted by the micro-batch's share of
        the step's pairs (with `aux_coef`).
        """
        losses, metrics = self.loss(policy, reference)
        loss_sum = torch.where(present, losses, torch.zeros_like(losses)).sum()
        objective = loss_sum / normalizer
        used = present.to(losses.dtype) * self._share()
        aux_share = torch.zeros((), dtype=losses.dtype, device=losses.device)
        if self.aux_coef and router_loss is not None:
            aux_share = router_loss.float() * (used.sum() / normalizer)
            objective = objective + self.aux_coef * aux_share
        sums = torch.stack([used.sum(), aux_share.detach(), *((metrics[k] * used).sum() for k in self.keys)])
        return objective, loss_sum.detach() * self._share(), sums

    def keep(self, sums: torch.Tensor, *, evaluation: bool = False) -> None:
        """Add a micro-batch's metric sums (`pair_loss`, `eval_loss`) to the step's or the evaluation's."""
        if evaluation:
            self._eval_sums = sums if self._eval_sums is None else self._eval_sums + sums
        else:
            self._sums = sums if self._sums is None else self._sums + sums

    def _share(self) -> float:
        """1, or under CP 0 on every CP rank but the one that counts the group's pairs."""
        return 1.0 if self.cp is None or self.cp.owner else 0.0

    def eval_forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """A validation batch (no gradient): its pair loss sum and pair count; keeps its metric sums."""
        if self.cp is not None:
            batch = self.cp.shard(batch)
        with torch.no_grad():
            reference = self.reference_logps(model, batch)
            policy, present = self._pair_logps(model, batch)
            loss_sum, sums = self.eval_loss(policy, present, reference)
        self.keep(sums, evaluation=True)
        return loss_sum, sums[0]

    def eval_loss(
        self, policy: PairLogps, present: torch.Tensor, reference: PairLogps | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A validation micro-batch's pair loss sum and its metric sums (the pair count first)."""
        losses, metrics = self.loss(policy, reference)
        used = present.to(losses.dtype) * self._share()
        sums = torch.stack([used.sum(), *((metrics[k] * used).sum() for k in METRIC_KEYS)])
        return torch.where(present, losses, torch.zeros_like(losses)).sum() * self._share(), sums

    def eval_metrics(self, group: dist.ProcessGroup | None) -> dict[str, float]:
        """`eval_<metric>` over the evaluation's pairs (one all-reduce); resets the sums."""
        sums, self._eval_sums = self._eval_sums, None
        return eval_means(sums, METRIC_KEYS, group)

    def step_metrics(self, group: dist.ProcessGroup | None) -> dict[str, float | int]:
        """The step's mean metrics over its global pairs (one all-reduce); resets the sums."""
        if self._sums is None:
            return {}
        summed = dist_utils.all_reduce_sum(self._sums, group)
        if self.over_groups is not None:
            summed = self.over_groups(summed)
        total = summed.tolist()
        self._sums = None
        pairs = max(total[0], 1.0)
        means = {k: v / pairs for k, v in zip(self.keys, total[2:], strict=True)}
        # aux_loss: the shares already divide by the step's pairs (replaces the trainer's zero).
        return {"pairs": int(total[0]), **({"aux_loss": total[1]} if self.aux_coef else {}), **means}


def eval_means(
    sums: torch.Tensor | None, keys: tuple[str, ...], group: dist.ProcessGroup | None
) -> dict[str, float]:
    """`eval_<key>` means of `[pairs, *metric sums]` summed over `group` (one all-reduce; {} without sums)."""
    if sums is None:
        return {}
    total = dist_utils.all_reduce_sum(sums, group).tolist()
    pairs = max(total[0], 1.0)
    return {f"eval_{k}": v / pairs for k, v in zip(keys, total[1:], strict=True)}
