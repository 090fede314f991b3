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
so peak memory holds one chunk's logits. `fused_linear_cross_entropy_sum` walks the same chunks
and takes each one's gradient in the forward instead. Both, and the evaluation-only sum, run the
one chunk loop `_walk_chunks`, and every formulation's softmax is `token_cross_entropy_sum`'s.

Under tensor parallelism with loss parallelism (`parallelism.enable_loss_parallel`) the logits
arrive as a DTensor sharded on the vocabulary (`Shard(-1)` over the TP ranks).
`cross_entropy_sum` then computes the loss Megatron's way on each rank's slice: the row maximum
and the sum of exponentials are all-reduced over the TP group (two `[tokens]` vectors instead of
gathering `[tokens, vocab]` logits), and the backward is local (softmax minus one-hot on the
slice), so it needs no `loss_parallel()` context around `backward()`. The result is a plain 0-dim
float32 tensor, equal on every TP rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor, Shard

IGNORE_INDEX = -100


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The gathered tensor of a DTensor (a differentiable collective), or the tensor itself."""
    dtensor = _as_dtensor(tensor)
    return dtensor.full_tensor() if dtensor is not None else tensor


def _as_dtensor(tensor: torch.Tensor) -> DTensor | None:
    """`tensor` as a DTensor, or None for a plain tensor (and where torch has no distributed)."""
    if not dist.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return tensor if isinstance(tensor, DTensor) else None


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy over positions whose label is not -100.

    Args:
        logits: [B, S, V] in any float dtype (upcast to float32 for the softmax).
        labels: [B, S] targets already aligned with the positions (labels[i] is the target of i).
            The logits may be a DTensor: sharded on the vocabulary (loss parallelism; the sum is
            then computed without gathering them) or replicated.

    Returns:
        A plain float32 0-dim tensor (the same on every tensor-parallel rank).
    """
    dlogits = _as_dtensor(logits)
    if dlogits is not None:
        dlabels = _as_dtensor(labels)
        if dlabels is not None:
            labels = dlabels.full_tensor()
        vocab_dim = _vocab_shard_dim(dlogits)
        if vocab_dim is not None:
            return _vocab_parallel_cross_entropy_sum(dlogits, labels, vocab_dim)
        logits = dlogits.full_tensor()
    return token_cross_entropy_sum(logits, labels)


def token_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of plain (local) logits ``[..., V]``, the softmax in float32.

    Every formulation ends here (the full-logits loss, each chunk of the chunked loss, and their
    compiled copies), so they round alike: logits of any dtype are upcast before the softmax.
    """
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def _vocab_shard_dim(logits: DTensor) -> int | None:
    """The mesh dim that shards `logits` on the vocabulary (last) dim, or None if none does.

    Raises:
        NotImplementedError: another mesh dim shards the logits too (only Replicate is allowed there).
    """
    last = logits.dim() - 1
    found = None
    for i, placement in enumerate(logits.placements):
        # is_shard() holds for the shard placements only, and each of them has a `dim`.
        if placement.is_shard() and cast("Shard", placement).dim % logits.dim() == last:
            found = i
        elif not placement.is_replicate():
            raise NotImplementedError(
                f"cross_entropy_sum: logits with placements {logits.placements}; only a vocabulary "
                "shard (loss parallelism) with the other mesh dims replicated is supported"
            )
    return found


class _VocabParallelCrossEntropySum(torch.autograd.Function):
    """Sum cross-entropy of vocabulary-sharded logits; the result is the full sum on every rank.

    Forward all-reduces the row max (for stability), the sum of exponentials and the target logit
    (held by exactly one rank) over `group`; backward is local: `softmax - one_hot` on the slice.
    """

    @staticmethod
    def forward(ctx, local, labels, vocab_start, group):
        local = local.float()
        row_max = local.detach().amax(dim=-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = local - row_max[:, None]
        valid = labels != IGNORE_INDEX
        index = labels - vocab_start
        mine = valid & (index >= 0) & (index < local.shape[-1])
        index = torch.where(mine, index, torch.zeros_like(index))
        target = shifted.gather(1, index[:, None]).squeeze(1) * mine
        exp = shifted.exp_()  # shifted is ours (a fresh tensor): reuse it
        sum_exp = exp.sum(dim=-1)
        stats = torch.stack([sum_exp, target])
        dist.all_reduce(stats, group=group)
        sum_exp, target = stats[0], stats[1]
        loss = torch.where(valid, sum_exp.log() - target, torch.zeros_like(target)).sum()
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), index, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, mine, valid = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        # Masks as factors, not boolean indexing: no data-dependent shape (no device sync, and a
        # dry run's fake tensors can run it). Each row is indexed once; `index` is 0 where not mine.
        grad[rows, index] -= mine.to(grad.dtype)
        grad.mul_(valid[:, None].to(grad.dtype))
        return grad.mul_(grad_loss), None, None, None


def _vocab_parallel_cross_entropy_sum(logits: DTensor, labels: torch.Tensor, mesh_dim: int) -> torch.Tensor:
    """`cross_entropy_sum` of logits sharded on the vocabulary over mesh dim `mesh_dim`."""
    mesh = logits.device_mesh
    size, rank = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    vocab = logits.shape[-1]
    # DTensor shards like torch.chunk: ceil(vocab / size) per rank, the last ones shorter.
    vocab_start = min(rank * -(-vocab // size), vocab)
    # to_local's backward wraps the local gradient back into the same vocab-sharded layout.
    local = logits.to_local()
    return _VocabParallelCrossEntropySum.apply(
        local.reshape(-1, local.shape[-1]), labels.reshape(-1), vocab_start, mesh.get_group(mesh_dim)
    )


def chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of one chunk's logits ``hidden @ weight.T`` (softmax in float32)."""
    return token_cross_entropy_sum(F.linear(hidden, weight), labels)


def chunk_loss_and_grad(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's summed cross-entropy and ``scale`` times its gradient with respect to the logits.

    The gradient of the sum is ``softmax - one_hot(label)`` on valid rows and zero on ignored
    ones; it is scaled (by the incoming gradient, when backward knows it) in float32 and
    returned in ``hidden``'s dtype (what the two matmuls that follow take). Under
    ``torch.compile`` the float32 cast, the softmax and the one-hot subtraction become one
    kernel over the chunk's logits.
    """
    logits = F.linear(hidden, weight).float()
    lse = torch.logsumexp(logits, dim=-1)
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    picked = logits.gather(1, safe[:, None]).squeeze(1)
    loss = torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
    # In place on the chunk's own float32 logits (callers run this without autograd): eagerly,
    # three passes over [chunk, vocab] and no second buffer.
    grad = logits.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
    grad.mul_((valid * scale)[:, None])
    return loss, grad.to(hidden.dtype)


@dataclass(frozen=True)
class LossSteps:
    """The loss functions the formulations call: these eager ones, or ``torch.compile``d copies.

    Attributes:
        plain: Summed cross-entropy of plain logits (:func:`token_cross_entropy_sum`).
        loss: One chunk's summed cross-entropy from the hidden states (:func:`chunk_loss_sum`).
        grad: One chunk's loss and scaled logits gradient (:func:`chunk_loss_and_grad`).
    """

    plain: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_cross_entropy_sum
    loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = chunk_loss_sum
    grad: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
    ] = chunk_loss_and_grad


EAGER_STEPS = LossSteps()


@dataclass
class _ChunkSums:
    """What one walk over the chunks returns: the loss sum, and the gradients when asked."""

    total: torch.Tensor
    grad_hidden: torch.Tensor | None = None
    grad_weight: torch.Tensor | None = None  # float32, whatever the weight's dtype


def _walk_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int,
    dtype: torch.dtype,
    steps: LossSteps,
    scale: torch.Tensor | None = None,
    need_hidden: bool = False,
    need_weight: bool = False,
) -> _ChunkSums:
    """The one loop over row chunks of ``hidden @ weight.T`` that every chunked path runs.

    Without ``scale`` it sums ``steps.loss`` (the forward of the recomputing loss, evaluation);
    with it, ``steps.grad`` also gives each chunk's ``scale * (softmax - one_hot)``, which
    becomes the chunk's rows of ``d hidden`` and its share of ``d weight`` (float32) before the
    next chunk's logits exist, so one chunk's logits and gradient are alive at a time.

    Matmuls run in ``dtype`` (the autocast dtype of the caller's forward, else the inputs'
    promoted dtype), like the plain path's ``lm_head`` under autocast; autocast is off inside,
    so that a backward (which runs outside the autocast region) rounds exactly where the
    forward did.
    """
    sums = _ChunkSums(torch.zeros((), dtype=torch.float32, device=hidden.device))
    if scale is not None:
        sums.grad_hidden = torch.empty_like(hidden) if need_hidden else None
        if need_weight:
            # The head gradient accumulates over chunks in float32; the caller casts it once.
            sums.grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    with torch.autocast(hidden.device.type, enabled=False):
        h_all, w = hidden.to(dtype), weight.to(dtype)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            h = h_all[rows]
            if scale is None:
                sums.total += steps.loss(h, w, labels[rows])
                continue
            loss, grad = steps.grad(h, w, labels[rows], scale)
            sums.total += loss
            _add_chunk_grads(grad, h, w, sums.grad_hidden, sums.grad_weight, rows)
            del grad  # freed before the next chunk's logits are allocated
    return sums


def _add_chunk_grads(
    grad: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    rows: slice,
) -> None:
    """``grad_h[rows] = grad @ w`` and ``grad_w += grad.T @ h`` (float32 accumulation)."""
    if grad_h is not None:
        grad_h[rows] = (grad @ w).to(grad_h.dtype)
    if grad_w is not None:
        if grad.dtype == torch.float32:
            grad_w.addmm_(grad.t(), h)  # no [V, H] temporary
        else:
            grad_w += grad.t() @ h


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum cross-entropy of ``hidden @ weight.T`` over row chunks, logits recomputed in backward.

    The forward keeps only its inputs; backward walks the chunks again with the incoming
    gradient as the scale (:func:`_walk_chunks`).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, dtype, steps):
        total = _walk_chunks(hidden, weight, labels, chunk_size=chunk_size, dtype=dtype, steps=steps).total
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk_size, ctx.dtype, ctx.steps = chunk_size, dtype, steps
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, labels = ctx.saved_tensors
        sums = _walk_chunks(
            hidden,
            weight,
            labels,
            chunk_size=ctx.chunk_size,
            dtype=ctx.dtype,
            steps=ctx.steps,
            scale=grad_total,
            need_hidden=ctx.needs_input_grad[0],
            need_weight=ctx.needs_input_grad[1],
        )
        grad_w = sums.grad_weight.to(weight.dtype) if sums.grad_weight is not None else None
        return sums.grad_hidden, grad_w, None, None, None, None


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Sum cross-entropy of ``hidden @ weight.T`` with both gradients computed in the forward.

    Each chunk's logits exist once: the forward takes the loss and ``softmax - one_hot`` of
    the chunk together and turns it into the chunk's rows of ``d hidden`` and its share of
    ``d weight`` (float32) at once, so no logits are kept or recomputed; backward only
    scales the two stored gradients. It holds ``[N, H]`` plus a float32 ``[V, H]`` between
    forward and backward instead of the plain path's ``[N, V]`` logits, and does the head's
    matmuls once each (the recomputing chunked path does the logits twice).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, dtype, steps):
        sums = _walk_chunks(
            hidden,
            weight,
            labels,
            chunk_size=chunk_size,
            dtype=dtype,
            steps=steps,
            scale=torch.ones((), dtype=torch.float32, device=hidden.device),
            need_hidden=ctx.needs_input_grad[0],
            need_weight=ctx.needs_input_grad[1],
        )
        ctx.save_for_backward(sums.grad_hidden, sums.grad_weight)
        ctx.weight_dtype = weight.dtype
        return sums.total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w = ctx.saved_tensors
        # The stored gradients are this graph's own: scaled in place (no retain_graph reuse).
        out_h = grad_h.mul_(grad_total) if grad_h is not None else None
        out_w = grad_w.mul_(grad_total).to(ctx.weight_dtype) if grad_w is not None else None
        return out_h, out_w, None, None, None, None


def _head_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmul dtype of the head: the forward's autocast dtype, else the inputs' promoted dtype."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _flat_head_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype]:
    """``hidden`` as ``[N, H]``, the whole weight, ``labels`` as ``[N]`` and the head's matmul dtype.

    Raises:
        ValueError: ``chunk_size`` is not positive (named as ``kernels.chunk_loss_size``).
    """
    if chunk_size < 1:
        raise ValueError(f"kernels.chunk_loss_size: must be a positive number of tokens, got {chunk_size}")
    hidden, weight = _whole(hidden), _whole(weight)
    return hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), _head_dtype(hidden, weight)


def fused_linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int,
    steps: LossSteps = EAGER_STEPS,
) -> torch.Tensor:
    """`cross_entropy_sum(hidden @ weight.T, labels)`, gradients taken chunk by chunk in the forward.

    Same arguments as :func:`chunked_cross_entropy_sum`. Without grad mode (evaluation), or
    when neither input needs a gradient, only the loss is computed.
    """
    flat, weight, flat_labels, dtype = _flat_head_inputs(hidden, weight, labels, chunk_size)
    if not torch.is_grad_enabled() or not (flat.requires_grad or weight.requires_grad):
        return _walk_chunks(
            flat, weight, flat_labels, chunk_size=int(chunk_size), dtype=dtype, steps=steps
        ).total
    return _FusedLinearCrossEntropy.apply(flat, weight, flat_labels, int(chunk_size), dtype, steps)


def chunked_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int,
    steps: LossSteps = EAGER_STEPS,
) -> torch.Tensor:
    """`cross_entropy_sum(hidden @ weight.T, labels)` without the full logits tensor.

    Args:
        hidden: Final (normed) hidden states ``[B, S, H]`` (or ``[N, H]``).
        weight: LM-head weight ``[V, H]`` (no bias).
        labels: ``[B, S]`` (or ``[N]``) targets, -100 ignored.
        chunk_size: Tokens per chunk (over the flattened batch and sequence).
        steps: The per-chunk steps (compiled copies under ``kernels.compile``).

    Under tensor parallelism ``hidden`` (sequence-sharded) and ``weight`` (vocabulary-sharded)
    are DTensors: they are gathered whole (differentiably: their backward hands each rank its
    own slice), so every TP rank computes the whole loss, as the replicated-logits path does.

    Returns:
        The float32 scalar sum over valid positions; its backward recomputes one chunk's
        logits at a time.
    """
    flat, weight, flat_labels, dtype = _flat_head_inputs(hidden, weight, labels, chunk_size)
    return _ChunkedLinearCrossEntropy.apply(flat, weight, flat_labels, int(chunk_size), dtype, steps)


def count_valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of positions that contribute to the loss (as an int64 scalar tensor)."""
    return (labels != IGNORE_INDEX).sum()


def mtp_labels(labels: torch.Tensor, depth: int, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Targets of multi-token-prediction depth ``depth`` (1-based): ``labels[i + depth]`` at ``i``.

    The last ``depth`` positions of a row have none (-100); in a packed row neither has a
    position whose target lies in another document or in padding.
    """
    tail = labels.new_full((*labels.shape[:-1], min(depth, labels.shape[-1])), IGNORE_INDEX)
    out = torch.cat([labels[..., depth:], tail], dim=-1)
    if segment_ids is not None:
        ahead = torch.cat([segment_ids[..., depth:], segment_ids.new_zeros(tail.shape)], dim=-1)
        out = out.masked_fill((ahead != segment_ids) | (segment_ids == 0), IGNORE_INDEX)
    return out


def mtp_cross_entropy_sum(
    outputs: list[torch.Tensor],
    labels: torch.Tensor,
    segment_ids: torch.Tensor | None = None,
    *,
    head_weight: torch.Tensor | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The mean over MTP depths of each depth's summed cross-entropy against ``mtp_labels``.

    The trainer divides it by the same global valid-token count as the main loss, so the
    logged ``mtp_loss`` is the per-token MTP cross-entropy averaged over the depths, and
    ``mtp_loss_scaling_factor`` times it is what the objective adds (Megatron's
    ``mtp_loss_scaling_factor / mtp_num_layers`` per depth).

    Args:
        outputs: Per depth (1..n), what the main forward returned: logits ``[B, S, V]``, or
            normed hidden states when ``loss_fn`` applies the head itself.
        labels: The main targets ``[B, S]`` (already shifted by one).
        segment_ids: ``[B, S]`` document ids of packed rows, or None.
        head_weight: The LM head's weight, handed to ``loss_fn`` (hidden-state losses).
        loss_fn: ``(output, targets, head_weight) -> summed CE`` of one depth: the run's
            :class:`meshforge.loss.lm.LMLoss`, so each depth takes the main loss's formulation;
            by default :func:`cross_entropy_sum` of logits.
    """
    if not outputs:
        raise ValueError("mtp_cross_entropy_sum: no MTP outputs (did the forward run the MTP depths?)")
    total = torch.zeros((), dtype=torch.float32, device=labels.device)
    for depth, out in enumerate(outputs, start=1):
        target = mtp_labels(labels, depth, segment_ids)
        if loss_fn is not None:
            total = total + loss_fn(out, target, head_weight)
        else:
            total = total + cross_entropy_sum(out, target)
    return total / len(outputs)
