"""Token-level cross-entropy with sum reduction.

The trainer divides the summed loss by the number of valid tokens in the whole global batch
(all micro-batches, all data-parallel ranks), so that gradient accumulation and data
parallelism give exactly the gradient of one big batch: averaging per micro-batch would weight
short and long micro-batches differently (the bug torchtune's issue #2307 describes).

`chunked_cross_entropy_sum` (the `kernels.chunk_loss_size` switch) computes the same sum from
the final hidden states and the LM-head weight, `chunk_size` tokens at a time, so the
full-vocabulary logits of the whole micro-batch never exist: at vocab 151,936 they are
0.6 MB per token in float32 (logits, their float32 copy, softmax and gradient each that
size in the plain path). Backward recomputes each chunk's logits instead of keeping them,
so peak memory holds one chunk's logits.
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


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum cross-entropy of ``hidden @ weight.T`` over row chunks, logits recomputed in backward.

    Matmuls run in ``dtype`` (the autocast dtype of the forward, else the hidden states'
    dtype), like the plain path's ``lm_head`` under autocast; the softmax is in float32 as
    in :func:`cross_entropy_sum`. Autocast is turned off inside so that backward (which
    runs outside the autocast region) rounds exactly where forward did.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, dtype):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            h_all, w = hidden.to(dtype), weight.to(dtype)
            for start in range(0, hidden.shape[0], chunk_size):
                logits = F.linear(h_all[start : start + chunk_size], w).float()
                total += F.cross_entropy(
                    logits, labels[start : start + chunk_size], ignore_index=IGNORE_INDEX, reduction="sum"
                )
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk_size, ctx.dtype = chunk_size, dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, labels = ctx.saved_tensors
        chunk_size, dtype = ctx.chunk_size, ctx.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        # Accumulate the head gradient over chunks in float32, then cast once.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            h_all, w = hidden.to(dtype), weight.to(dtype)
            for start in range(0, hidden.shape[0], chunk_size):
                h = h_all[start : start + chunk_size]
                target = labels[start : start + chunk_size]
                # d(sum CE)/d(logits) = softmax - one_hot(target), zero on ignored rows.
                grad = torch.softmax(F.linear(h, w).float(), dim=-1)
                valid = target != IGNORE_INDEX
                rows = torch.arange(target.shape[0], device=target.device)
                grad[rows[valid], target[valid]] -= 1.0
                grad[~valid] = 0.0
                grad = grad.mul_(grad_total).to(dtype)  # in place: one chunk-sized buffer fewer
                if need_h:
                    grad_h[start : start + chunk_size] = (grad @ w).to(hidden.dtype)
                if need_w:
                    if dtype == torch.float32:
                        grad_w.addmm_(grad.t(), h)  # no [V, H] temporary
                    else:
                        grad_w += grad.t() @ h
                del grad
        return grad_h, grad_w.to(weight.dtype) if need_w else None, None, None, None


def chunked_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int
) -> torch.Tensor:
    """`cross_entropy_sum(hidden @ weight.T, labels)` without the full logits tensor.

    Args:
        hidden: Final (normed) hidden states ``[B, S, H]`` (or ``[N, H]``).
        weight: LM-head weight ``[V, H]`` (no bias).
        labels: ``[B, S]`` (or ``[N]``) targets, -100 ignored.
        chunk_size: Tokens per chunk (over the flattened batch and sequence).

    Returns:
        The float32 scalar sum over valid positions; its backward recomputes one chunk's
        logits at a time.
    """
    if chunk_size < 1:
        raise ValueError(f"kernels.chunk_loss_size: must be a positive number of tokens, got {chunk_size}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedLinearCrossEntropy.apply(flat, weight, labels.reshape(-1), int(chunk_size), dtype)


def count_valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of positions that contribute to the loss (as an int64 scalar tensor)."""
    return (labels != IGNORE_INDEX).sum()
