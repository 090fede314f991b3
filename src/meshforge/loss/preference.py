"""Preference losses (DPO and its variants) from per-sequence log-probabilities.

A pair is one prompt with a chosen and a rejected answer. The policy's (and, where the loss has
one, the reference model's) log-probability of each answer is the sum of its answer tokens'
log-probabilities; IPO, ORPO and SimPO use the mean over the answer tokens instead, as their
papers and LLaMA-Factory's `CustomDPOTrainer.concatenated_forward` define them. With
`h = (pi_c - ref_c) - (pi_r - ref_r)` (policy minus reference log-ratio of the pair):

    sigmoid  -(1 - ls) * logsigmoid(beta * h) - ls * logsigmoid(-beta * h)   (DPO; ls = label smoothing)
    hinge    relu(1 - beta * h)
    ipo      (h - 1 / (2 * beta)) ** 2                                         (h from mean log-probs)
    orpo     -pi_c + beta * -logsigmoid(log_odds(pi_c) - log_odds(pi_r))    (no reference)
    simpo    -logsigmoid(beta * (pi_c - pi_r) - gamma)                      (no reference)

with `log_odds(p) = p - log(1 - exp(p))`. `pref_ftx > 0` adds `ftx * -(mean chosen log-prob)`,
an SFT term on the chosen answer (LLaMA-Factory's `pref_ftx`). Rewards are `beta * (pi - ref)`
with a reference, `beta * pi` without (TRL's and LLaMA-Factory's metrics).

Every function returns per-pair values; the trainer sums them over the micro-batch and divides by
the global number of pairs, so the gradient is that of the mean over the global batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshforge.loss.cross_entropy import IGNORE_INDEX

PREF_LOSSES = ("sigmoid", "hinge", "ipo", "orpo", "simpo")
# Losses without a reference model.
REFERENCE_FREE = ("orpo", "simpo")
# Losses on the mean (not the sum) of the answer tokens' log-probabilities.
LENGTH_AVERAGED = ("ipo", "orpo", "simpo")
METRIC_KEYS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


@dataclass(frozen=True)
class PairLogps:
    """Summed answer log-probabilities of chosen and rejected answers `[pairs]` and their token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    @classmethod
    def from_rows(cls, sums: torch.Tensor, counts: torch.Tensor) -> PairLogps:
        """Split per-row values of a pairwise batch (the chosen rows first, then the rejected ones)."""
        pairs = sums.shape[0] // 2
        return cls(sums[:pairs], sums[pairs:], counts[:pairs], counts[pairs:])

    def averaged(self) -> PairLogps:
        """The same with each sum divided by its answer's token count (at least 1)."""
        c = self.chosen_tokens.clamp(min=1).to(self.chosen.dtype)
        r = self.rejected_tokens.clamp(min=1).to(self.rejected.dtype)
        return PairLogps(self.chosen / c, self.rejected / r, self.chosen_tokens, self.rejected_tokens)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the summed log-probability of the labelled tokens and their count.

    Args:
        logits: `[rows, S, V]` (upcast to float32 for the softmax).
        labels: `[rows, S]`, already shifted (labels[i] is the target of position i); -100 = none.

    Returns:
        `(sums [rows] float32, counts [rows] int64)`.
    """
    token_logps = -F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(labels.shape)
    valid = labels != IGNORE_INDEX
    return token_logps.sum(dim=-1), valid.sum(dim=-1)


@dataclass(frozen=True)
class PreferenceLoss:
    """One preference objective (see the module docstring); LLaMA-Factory's field names.

    Attributes:
        loss_type: one of `PREF_LOSSES` (`pref_loss`).
        beta: `pref_beta`.
        label_smoothing: `dpo_label_smoothing` (sigmoid only).
        simpo_gamma: SimPO's target margin.
        ftx: `pref_ftx`, the weight of the SFT term on the chosen answer.
    """

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    ftx: float = 0.0

    def __post_init__(self) -> None:
        if self.loss_type not in PREF_LOSSES:
            raise ValueError(f"pref_loss: {self.loss_type!r} is not one of {', '.join(PREF_LOSSES)}")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares against a reference model."""
        return self.loss_type not in REFERENCE_FREE

    def __call__(
        self, policy: PairLogps, reference: PairLogps | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-pair losses `[pairs]` and per-pair metric values (`METRIC_KEYS`, detached).

        `policy` and `reference` hold summed log-probabilities; the length-averaged losses
        divide them here.
        """
        averaged = self.loss_type in LENGTH_AVERAGED
        pi = policy.averaged() if averaged else policy
        if self.needs_reference:
            if reference is None:
                raise ValueError(f"pref_loss {self.loss_type!r} needs reference log-probabilities")
            ref = reference.averaged() if averaged else reference
            chosen_ratio = pi.chosen - ref.chosen.detach()
            rejected_ratio = pi.rejected - ref.rejected.detach()
            losses = self._with_reference(chosen_ratio - rejected_ratio)
            chosen_rewards = self.beta * chosen_ratio.detach()
            rejected_rewards = self.beta * rejected_ratio.detach()
        else:
            losses = self._reference_free(pi.chosen, pi.rejected)
            chosen_rewards = self.beta * pi.chosen.detach()
            rejected_rewards = self.beta * pi.rejected.detach()
        extra: dict[str, torch.Tensor] = {}
        if self.loss_type == "orpo":
            extra["sft_loss"] = -pi.chosen.detach()
            extra["odds_ratio_loss"] = (losses.detach() + pi.chosen.detach()) / self.beta
        if self.ftx > 1e-6:
            losses = losses + self.ftx * -policy.averaged().chosen
        metrics = {
            "rewards/chosen": chosen_rewards,
            "rewards/rejected": rejected_rewards,
            "rewards/accuracies": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype),
            "rewards/margins": chosen_rewards - rejected_rewards,
            "logps/chosen": pi.chosen.detach(),
            "logps/rejected": pi.rejected.detach(),
            **extra,
        }
        return losses, metrics

    def _with_reference(self, h: torch.Tensor) -> torch.Tensor:
        beta = self.beta
        if self.loss_type == "sigmoid":
            ls = self.label_smoothing
            return -F.logsigmoid(beta * h) * (1 - ls) - F.logsigmoid(-beta * h) * ls
        if self.loss_type == "hinge":
            return torch.relu(1 - beta * h)
        return (h - 1 / (2 * beta)) ** 2  # ipo

    def _reference_free(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        if self.loss_type == "orpo":
            # log(1 - exp(p)) for p < 0 without cancellation: log(-expm1(p)).
            log_odds = (chosen - rejected) - (
                torch.log(-torch.expm1(chosen)) - torch.log(-torch.expm1(rejected))
            )
            return -chosen + self.beta * -F.logsigmoid(log_odds)
        return -F.logsigmoid(self.beta * (chosen - rejected) - self.simpo_gamma)  # simpo


def first_step_loss(loss: PreferenceLoss) -> float:
    """The loss of a pair whose policy equals its reference (h = 0), without the SFT term."""
    if loss.loss_type == "sigmoid":
        return math.log(2.0)
    if loss.loss_type == "hinge":
        return 1.0
    if loss.loss_type == "ipo":
        return (1 / (2 * loss.beta)) ** 2
    raise ValueError(f"pref_loss {loss.loss_type!r} has no reference model")
