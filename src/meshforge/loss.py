"""Token-level cross-entropy with sum reduction.

The trainer divides the summed loss by the number of valid tokens in the whole global batch
(all micro-batches, all data-parallel ranks), so that gradient accumulation and data
parallelism give exactly the gradient of one big batch: averaging per micro-batch would weight
short and long micro-batches differently (the bug torchtune's issue #2307 describes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy over positions whose label is not -100.

    Args:
        logits: [B, S, V] in any float dtype (upcast to float32 for the softmax).
        labels: [B, S] targets already aligned with the positions (labels[i] is the target of i).
    """
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits.reshape(-1, vocab).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def count_valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of positions that contribute to the loss (as an int64 scalar tensor)."""
    return (labels != IGNORE_INDEX).sum()
