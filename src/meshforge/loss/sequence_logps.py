"""Summed log-probabilities of whole sequences (the answers of preference pairs).

A preference row holds the sequences of its pairs as segments (`segment_ids` 2k + 1 = chosen
and 2k + 2 = rejected answer of the row's pair k; one pair per row unless packed;
`data/sft/pairwise.py`). A position counts toward its segment's sum when its label is valid and its
target token lies in the same segment: a label that crosses into the next segment (or into
padding) belongs to no sequence. This is LLaMA-Factory's and TRL's shifted `get_batch_logps`
applied to each sequence on its own.

Only the labelled positions reach the head. From normed hidden states (`kernels.chunk_loss_size`
or `kernels.fused_linear_cross_entropy`) the head runs chunk by chunk, each chunk's logits
computed in the forward and once more in backward (`_SequenceLogps`), so no `[tokens, vocab]`
tensor exists. The fused path's trick (gradients taken in the forward) does not apply: each
sequence's upstream gradient comes from the preference loss, known only in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshforge.loss.cross_entropy import EAGER_STEPS, IGNORE_INDEX, _add_chunk_grads, _head_dtype, _whole
from meshforge.utils.fake_values import on_host


def segments_per_row(segment_ids: torch.Tensor) -> int:
    """Sequence slots per row: the largest segment id, rounded up to whole pairs (at least one)."""
    top = int(segment_ids.max()) if segment_ids.numel() else 0
    return max(2, top + top % 2)


def _counted_and_keys(
    labels: torch.Tensor, segment_ids: torch.Tensor, slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[rows, S]` masks of the positions that count and every position's sequence key."""
    seg = segment_ids
    # The target of position i is token i + 1: it must be in i's segment (the last position never is).
    same_next = torch.zeros_like(seg, dtype=torch.bool)
    same_next[:, :-1] = seg[:, :-1] == seg[:, 1:]
    counted = (labels != IGNORE_INDEX) & (seg > 0) & same_next
    rows = torch.arange(labels.shape[0], device=labels.device)[:, None]
    return counted, rows * slots + seg - 1


def pairs_in_rows(labels: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """The pairs of whole rows: each row's last rejected segment id is twice its pairs (rows with labels)."""
    return ((segment_ids.amax(dim=1) // 2) * (labels != IGNORE_INDEX).any(dim=1)).sum()


@dataclass(frozen=True)
class SequenceLayout:
    """Which positions of a batch count for which sequence (`sequence_layout`).

    Attributes:
        positions: flat positions `[N]` of the (local) batch whose log-probability counts.
        keys: the sequence key of each (`row * slots + segment - 1`).
        counts: labelled tokens of every sequence `[rows * slots]` (whole rows).
        present: which pair slots hold a pair `[rows * slots / 2]`.
    """

    positions: torch.Tensor
    keys: torch.Tensor
    counts: torch.Tensor
    present: torch.Tensor

    @property
    def num_keys(self) -> int:
        return self.counts.shape[0]


def sequence_layout(
    labels: torch.Tensor, segment_ids: torch.Tensor, local_index: torch.Tensor | None = None
) -> SequenceLayout:
    """The layout of whole rows `labels`, `segment_ids` `[rows, S]`.

    `local_index` (context parallelism: the global positions this rank holds, in its local order)
    makes `positions` index this rank's `[rows, len(local_index)]` slice of the rows, while the
    segments, counts and pair slots still come from the whole rows, the same on every rank. The
    layout's sizes depend on the values: on a dry run's fake tensors it is computed from the
    batch's host values (`utils/fake_values.py`).
    """
    parts = on_host(_layout, labels, segment_ids, local_index, what="the preference stage's answer tokens")
    return SequenceLayout(*parts)


def _layout(
    labels: torch.Tensor, segment_ids: torch.Tensor, local_index: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    slots = segments_per_row(segment_ids)
    counted, keys = _counted_and_keys(labels, segment_ids, slots)
    num_keys = labels.shape[0] * slots
    counts = torch.bincount(keys[counted], minlength=num_keys)
    tokens = torch.bincount(keys[segment_ids > 0], minlength=num_keys)
    if local_index is not None:
        counted, keys = counted[:, local_index], keys[:, local_index]
    positions = counted.reshape(-1).nonzero().squeeze(1)
    # A pair slot is used when its rejected segment exists in a row with labels (an evaluation's
    # padding rows, copies of a sample without labels, hold none).
    labelled = (labels != IGNORE_INDEX).any(dim=1).repeat_interleave(slots // 2)
    present = (tokens.view(-1, 2)[:, 1] > 0) & labelled
    return positions, keys.reshape(-1)[positions], counts, present


def _chunk_token_logps(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(h, w).float()
    picked = logits.gather(1, labels[:, None]).squeeze(1)
    return picked - torch.logsumexp(logits, dim=-1)


class _SequenceLogps(torch.autograd.Function):
    """Per-sequence sums of `log softmax(hidden @ weight.T)[label]`, one chunk of logits at a time.

    Forward keeps its inputs only; backward walks the chunks again with each token's upstream
    gradient (its sequence's) as the scale of `softmax - one_hot` (the chunked loss's step).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, keys, num_keys, chunk_size, dtype):
        sums = torch.zeros(num_keys, dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            h_all, w = hidden.to(dtype), weight.to(dtype)
            for start in range(0, hidden.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                sums.index_add_(0, keys[rows], _chunk_token_logps(h_all[rows], w, labels[rows]))
        ctx.save_for_backward(hidden, weight, labels, keys)
        ctx.chunk_size, ctx.dtype = chunk_size, dtype
        return sums

    @staticmethod
    def backward(ctx, grad_sums):
        hidden, weight, labels, keys = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        # d logp / d logits = one_hot - softmax: the cross-entropy step's gradient, negated.
        scale = -grad_sums.float()[keys]
        with torch.autocast(hidden.device.type, enabled=False):
            h_all, w = hidden.to(ctx.dtype), weight.to(ctx.dtype)
            for start in range(0, hidden.shape[0], ctx.chunk_size):
                rows = slice(start, start + ctx.chunk_size)
                h = h_all[rows]
                _, grad = EAGER_STEPS.grad(h, w, labels[rows], scale[rows])
                _add_chunk_grads(grad, h, w, grad_h, grad_w, rows)
                del grad
        out_w = grad_w.to(weight.dtype) if grad_w is not None else None
        return grad_h, out_w, None, None, None, None, None


def sequence_logps(
    output: torch.Tensor,
    labels: torch.Tensor,
    segment_ids: torch.Tensor,
    *,
    head_weight: torch.Tensor | None = None,
    chunk_size: int | None = None,
    layout: SequenceLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed log-probabilities and labelled-token counts of every sequence of a pair batch.

    Args:
        output: logits `[rows, S, V]`, or normed hidden states `[rows, S, H]` with `head_weight`.
        labels: `[rows, S]`, shifted (labels[i] is the target of position i), -100 ignored.
        segment_ids: `[rows, S]`, 2k + 1 and 2k + 2 for the sequences of a row's pair k, 0 padding.
        head_weight: the LM head `[V, H]` when `output` holds hidden states.
        chunk_size: tokens per chunk of the head (hidden states only).
        layout: the positions that count, when the caller computed them from whole rows (under
            context parallelism `output` and `labels` are this rank's slice); None: from
            `labels` and `segment_ids`. The sums are then this slice's part of each sequence's.

    Returns:
        `(sums [P, 2] float32, counts [P, 2] int64, present [P] bool)` over the pair slots
        `P = rows * slots / 2` (pair k of row r is slot `r * slots / 2 + k`): column 0 the chosen
        sequence, column 1 the rejected one; `present` marks the slots that hold a pair.
    """
    # Under tensor parallelism the logits (vocabulary-sharded) or the hidden states (sequence-sharded)
    # are gathered whole, differentiably: every TP rank computes every sum, as the LM loss does.
    output = _whole(output)
    if layout is None:
        layout = sequence_layout(labels, segment_ids)
    positions, keys, num_keys = layout.positions, layout.keys, layout.num_keys
    flat_labels = labels.reshape(-1)[positions]
    picked = output.reshape(-1, output.shape[-1])[positions]
    if head_weight is None:
        token_logps = -F.cross_entropy(picked.float(), flat_labels, reduction="none")
        sums = torch.zeros(num_keys, dtype=torch.float32, device=output.device).index_add(
            0, keys, token_logps
        )
    else:
        if chunk_size is None or chunk_size < 1:
            raise ValueError("sequence_logps: hidden states need a positive chunk_size")
        weight = _whole(head_weight)
        dtype = _head_dtype(picked, weight)
        sums = _SequenceLogps.apply(picked, weight, flat_labels, keys, num_keys, int(chunk_size), dtype)
    return sums.view(-1, 2), layout.counts.view(-1, 2), layout.present
