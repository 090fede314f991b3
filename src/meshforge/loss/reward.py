"""The pairwise reward-model loss and the scalar head's value at each sequence's last token.

A reward model scores a whole sequence with one number: a linear head `hidden -> 1` (no bias,
transformers' `*ForSequenceClassification.score`) read at the sequence's last token, where the
causal model has seen all of it. Preference rows hold a pair's sequences as segments
(`data/sft/pairwise.py`: 2k + 1 = chosen, 2k + 2 = rejected answer of the row's pair k), so the
last token of each segment gives the two rewards of its pair. The loss of a pair is
`-logsigmoid(r_chosen - r_rejected)` (LLaMA-Factory's `PairwiseTrainer`, TRL's `RewardTrainer`).

Only the `2 * pairs` last-token hidden states reach the head: no `[tokens, vocab]` logits and no
`[tokens, 1]` values exist.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshforge.loss.cross_entropy import _whole
from meshforge.loss.sequence_logps import segments_per_row
from meshforge.utils.fake_values import on_host

METRIC_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def last_token_positions(segment_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat position of every sequence slot's last token, and which slots hold a pair.

    The slots depend on the values: on a dry run's fake tensors they come from the batch's host
    values (`utils/fake_values.py`).

    Returns:
        `(positions [P, 2] int64, present [P] bool)` over the pair slots `P = rows * slots / 2`
        (slot order as `sequence_logps`); an absent sequence points at position 0.
    """
    return on_host(_last_tokens, segment_ids, what="the reward stage's last tokens")


def _last_tokens(segment_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, seq = segment_ids.shape
    slots = segments_per_row(segment_ids)
    row_index = torch.arange(rows, device=segment_ids.device)[:, None].expand(rows, seq)
    flat = torch.arange(rows * seq, device=segment_ids.device).view(rows, seq)
    keys = (row_index * slots + segment_ids - 1).reshape(-1)
    used = segment_ids.reshape(-1) > 0
    # Within a key the positions rise, so the largest one is the sequence's last token.
    last = torch.zeros(rows * slots, dtype=torch.int64, device=segment_ids.device)
    last = last.scatter_reduce(0, keys[used], flat.reshape(-1)[used], reduce="amax", include_self=True)
    counts = torch.bincount(keys[used], minlength=rows * slots)
    present = counts.view(-1, 2)[:, 1] > 0
    return last.view(-1, 2), present


def pair_rewards(
    hidden: torch.Tensor, segment_ids: torch.Tensor, head_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's value at the last token of every sequence of a pair batch.

    Args:
        hidden: the final normed hidden states `[rows, S, H]` (a sequence-sharded DTensor under
            tensor parallelism: gathered whole, differentiably, as `sequence_logps` does).
        segment_ids: `[rows, S]`, 2k + 1 and 2k + 2 for the sequences of a row's pair k, 0 padding.
        head_weight: the value head `[1, H]` (a replicated DTensor under TP: used whole).

    Returns:
        `(rewards [P, 2] float32, present [P] bool)`: column 0 the chosen sequence, 1 the rejected.
    """
    hidden = _whole(hidden)
    positions, present = last_token_positions(segment_ids)
    picked = hidden.reshape(-1, hidden.shape[-1])[positions.reshape(-1)]
    weight = _whole(head_weight)
    values = F.linear(picked, weight.to(picked.dtype)).float().view(-1, 2)
    return values, present


def pairwise_loss(rewards: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses `[P]` from rewards `[P, 2]` and the per-pair metrics (`METRIC_KEYS`, detached)."""
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    losses = -F.logsigmoid(chosen - rejected)
    c, r = chosen.detach(), rejected.detach()
    metrics = {
        "rewards/chosen": c,
        "rewards/rejected": r,
        "rewards/accuracies": (c > r).to(c.dtype),
        "rewards/margins": c - r,
    }
    return losses, metrics
