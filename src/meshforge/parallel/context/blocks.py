"""The block-level pieces of context parallelism: masks, attention kernels, the fused ring, head exchanges.

:mod:`meshforge.parallel.context` decides, per method and forward, which query block meets
which key/value block and who talks to whom; this module holds what it runs on those
blocks, so each file stays readable:

* :func:`allowed_mask`: which keys a query may see (causal, same document, sliding window),
  always in global sequence positions;
* :func:`attend`: single-device attention of a query block (SDPA, or gpt-oss'
  explicit-softmax ``sink_attention`` when per-head sinks are given);
* :func:`block_update`: one key/value block folded into running (max, sum, weighted values),
  the flash-attention recurrence the ring runs under autograd off CPU;
* :class:`FusedRing`: the ring on CPU with PyTorch's fused flash kernel, forward and
  backward rings written out (sinks folded into the final log-sum-exp);
* :func:`seq_to_heads` / :func:`heads_to_seq`: the ulysses all-to-alls.

Exchanges use the autograd-aware functional collectives, except inside ``FusedRing``
(which writes its own backward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed import _functional_collectives as funcol

from meshforge.models.common.sink_attention import causal_mask, sink_attention


def wait(x: torch.Tensor) -> torch.Tensor:
    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x


def host_index(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A token-position index (a function of the sequence length and the rank, never of data)
    built outside any fake-tensor mode: the ring's block plan reads its values on the host
    (:func:`runs`), which a dry run on fake tensors (`train/dry_run.py`) could not otherwise."""
    if torch.compiler.is_compiling():
        return make()
    with unset_fake_temporarily():
        return make()


def runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive positions in ``index``: (local offset, global start, length)."""
    values = index.tolist()
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            runs.append((start, values[start], i - start))
            start = i
    return runs


def allowed_mask(
    q_index: torch.Tensor,
    k_index: torch.Tensor,
    segments: torch.Tensor | None,
    causal: bool,
    window: int | None = None,
) -> torch.Tensor | None:
    """Boolean ``[B or 1, 1, Sq, Sk]``: key j visible to query i; None = all.

    Visible: ``j <= i`` when ``causal``, same document when ``segments`` are given, and
    ``j > i - window`` when ``window`` is set (the sliding-window rule of
    ``sink_attention.sliding_window_mask``, in global positions, so a window reaches
    back across the CP ranks' chunk boundaries exactly as on one process).
    """
    mask = (k_index[None, :] <= q_index[:, None])[None, None] if causal else None
    if window is not None:
        band = (k_index[None, :] > q_index[:, None] - window)[None, None]
        mask = band if mask is None else mask & band
    if segments is not None:
        same = (segments[:, q_index][:, :, None] == segments[:, k_index][:, None, :])[:, None]
        mask = same if mask is None else mask & same
    return mask


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Single-device attention of ``q`` ``[B, H, Sq, D]`` over ``k``/``v`` ``[B, Hkv, Sk, D]``.

    ``allowed`` None means plain causal over equal query and key positions. Without
    ``sinks`` this is SDPA; with them the explicit-softmax ``sink_attention`` that gpt-oss
    runs on one process (same arithmetic, so ulysses and kvallgather match it closely).
    """
    if sinks is None:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=allowed,
            is_causal=allowed is None,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    batch, heads, q_len, dim = q.shape
    kv_heads = k.shape[1]
    if allowed is None:
        allowed = causal_mask(q_len, q.device)
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, q_len, dim)
    out = sink_attention(grouped, k.unsqueeze(2), v.unsqueeze(2), sinks, allowed, scaling=scale)
    return out.reshape(batch, heads, q_len, v.shape[-1])


def block_update(
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one key/value block into a query block's running (max, sum, weighted values).

    ``q`` is ``[B, Hkv, G, Sq, D]`` (query heads grouped by their K/V head), ``k``/``v``
    ``[B, Hkv, Sk, D]``. The running max is detached: softmax does not depend on the
    shift, so treating it as a constant gives exact gradients and avoids differentiating
    through max. Rows a block masks entirely contribute exp(-inf) = 0 with no NaN; every
    row sees at least its own token somewhere, so the final sum is positive.
    """
    # Scores, probabilities and the running sums in float32 whatever the compute dtype
    # (SDPA accumulates bf16 attention in float32 too); the value product in v's dtype.
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    block_max = scores.detach().amax(dim=-1)
    new_max = block_max if state is None else torch.maximum(state[0], block_max)
    shift = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
    probs = torch.exp(scores - shift.unsqueeze(-1))
    block_sum = probs.sum(dim=-1)
    block_out = torch.matmul(probs.to(v.dtype), v.unsqueeze(2)).float()
    if state is None:
        return new_max, block_sum, block_out
    rescale = torch.exp(state[0] - shift)
    return new_max, state[1] * rescale + block_sum, state[2] * rescale.unsqueeze(-1) + block_out


_FLASH_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass
class Block:
    """One (query run, key run) pair of a ring step.

    ``allowed`` is the boolean visibility ``[B or 1, 1, q_n, k_n]`` (None: all visible);
    ``kernel_causal`` says the flash kernel's own causal flag expresses it exactly.
    """

    q_off: int
    q_n: int
    k_off: int
    k_n: int
    allowed: torch.Tensor | None
    kernel_causal: bool
    _additive: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def additive(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as the flash kernel takes it (0 or -inf, in the query dtype), or None."""
        if self.allowed is None or self.kernel_causal:
            return None
        if dtype not in self._additive:
            zeros = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
            self._additive[dtype] = zeros.masked_fill(~self.allowed, float("-inf"))
        return self._additive[dtype]

    def dead_rows(self) -> torch.Tensor | None:
        """Queries that see no key of this block ``[B or 1, 1, q_n]`` (documents, windows), or None."""
        if self.allowed is None or self.kernel_causal:
            return None
        return ~self.allowed.any(dim=-1)


def _ring_send(cp: Any, x: torch.Tensor) -> torch.Tensor:
    """``ContextParallel._ring_shift`` without autograd (inside ``FusedRing``), waited."""
    n, r = cp.ring_size, cp.ring_rank
    send, recv = [0] * n, [0] * n
    send[(r + 1) % n] = recv[(r - 1) % n] = x.shape[0]
    return funcol.all_to_all_single(x.contiguous(), recv, send, cp.ring_group)


class FusedRing(torch.autograd.Function):
    """Ring attention on CPU with the fused flash kernel, forward and backward rings explicit.

    Forward: each block gives (output, log-sum-exp); they merge into the running pair.
    Backward: K/V travel the ring again with their gradient accumulators; each block's
    gradients come from the kernel's backward given the FINAL output and log-sum-exp
    (the block's share of the global softmax), and after ring_size shifts every K/V
    gradient is back on the rank that owns the block.

    Sinks (one logit per head, no value) join after the last block: the log-sum-exp
    becomes ``logaddexp(lse, sink)`` and the output shrinks by ``exp(lse_old - lse)``
    (``sigmoid(lse_old - sink)``). Given that final pair, the kernel's backward is exactly
    the sink softmax's (probabilities ``exp(s - lse)``, ``D = rowsum(dO * out)`` with the
    sink's value 0), and the sink's own gradient is ``-sum exp(sink - lse) * D``.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, cp: Any, plan: list[list[Block]], scale: float):
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step, blocks in enumerate(plan):
            incoming = _ring_send(cp, kv) if step < cp.ring_size - 1 else None
            for b in blocks:
                qs, ks = slice(b.q_off, b.q_off + b.q_n), slice(b.k_off, b.k_off + b.k_n)
                o_b, l_b = _FLASH_FWD(
                    q[:, :, qs],
                    kv[0][:, :, ks],
                    kv[1][:, :, ks],
                    0.0,
                    b.kernel_causal,
                    attn_mask=b.additive(q.dtype),
                    scale=scale,
                )
                dead = b.dead_rows()
                if dead is not None:
                    # The kernel reports 0 (not -inf) for rows with nothing visible.
                    l_b = l_b.masked_fill(dead, float("-inf"))
                l_old = lse[:, :, qs]
                l_new = torch.logaddexp(l_old, l_b)
                shift = torch.where(torch.isfinite(l_new), l_new, torch.zeros_like(l_new))
                out[:, :, qs] = out[:, :, qs] * torch.exp(l_old - shift).unsqueeze(
                    -1
                ) + o_b.float() * torch.exp(l_b - shift).unsqueeze(-1)
                lse[:, :, qs] = l_new
            if incoming is not None:
                kv = wait(incoming)
        if sinks is not None:
            sink = sinks.float().view(1, -1, 1).expand_as(lse)
            total = torch.logaddexp(lse, sink)
            out = out * torch.exp(lse - total).unsqueeze(-1)
            lse = total
        out = out.to(q.dtype)
        ctx.cp, ctx.plan, ctx.scale = cp, plan, scale
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        cp, plan = ctx.cp, ctx.plan
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for step, blocks in enumerate(plan):
            incoming = _ring_send(cp, kv) if step < cp.ring_size - 1 else None
            for b in blocks:
                qs, ks = slice(b.q_off, b.q_off + b.q_n), slice(b.k_off, b.k_off + b.k_n)
                gq, gk, gv = _FLASH_BWD(
                    grad_out[:, :, qs],
                    q[:, :, qs],
                    kv[0][:, :, ks],
                    kv[1][:, :, ks],
                    out[:, :, qs],
                    lse[:, :, qs],
                    0.0,
                    b.kernel_causal,
                    attn_mask=b.additive(q.dtype),
                    scale=ctx.scale,
                )
                dq[:, :, qs] += gq
                dkv[0, :, :, ks] += gk
                dkv[1, :, :, ks] += gv
            # The accumulator travels with its K/V block; ring_size shifts bring it home.
            dkv = wait(_ring_send(cp, dkv))
            if incoming is not None:
                kv = wait(incoming)
        d_sinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            rows = (grad_out.float() * out.float()).sum(-1)  # D of every query row [B, H, S]
            weight = torch.exp(sinks.float().view(1, -1, 1) - lse)  # the sink's probability
            d_sinks = -(weight * rows).sum(dim=(0, 2)).to(sinks.dtype)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), d_sinks, None, None, None


def seq_to_heads(tensors: list[torch.Tensor], u: int, group: Any) -> list[torch.Tensor]:
    """One all-to-all: ``[B, h, S_local, D]`` each -> ``[B, h / u, u * S_local, D]`` (members' order)."""
    batch, _, local, dim = tensors[0].shape
    parts = [t.reshape(batch, u, t.shape[1] // u, local, dim) for t in tensors]
    sizes = [p.shape[2] for p in parts]
    x = torch.cat(parts, dim=2).transpose(0, 1).contiguous()  # [u (destination), B, heads, S_local, D]
    y = funcol.all_to_all_single_autograd(x, None, None, group)  # [u (source), B, heads, S_local, D]
    y = y.permute(1, 2, 0, 3, 4).reshape(batch, sum(sizes), u * local, dim)
    return list(y.split(sizes, dim=1))


def heads_to_seq(x: torch.Tensor, u: int, group: Any) -> torch.Tensor:
    """The inverse all-to-all: ``[B, h, u * S_local, D]`` -> ``[B, h * u, S_local, D]``."""
    batch, heads, seq, dim = x.shape
    y = x.reshape(batch, heads, u, seq // u, dim).permute(2, 0, 1, 3, 4).contiguous()
    y = funcol.all_to_all_single_autograd(y, None, None, group)  # [u (head group), B, h, S_local, D]
    return y.transpose(0, 1).reshape(batch, u * heads, seq // u, dim)


__all__ = [
    "Block",
    "FusedRing",
    "allowed_mask",
    "attend",
    "block_update",
    "heads_to_seq",
    "runs",
    "seq_to_heads",
    "wait",
]
