"""The Mamba-3 state-space recurrence: a chunked scan for training and the token-by-token form.

Per head, with ``k_t``/``q_t`` the rotated B/C projections (``R`` of them for MIMO), ``v_t``
the value rows, ``alpha_t = exp(A_t dt_t)``, ``lambda_t = sigmoid(trap_t)`` and the state
``h`` (``P x N``), the exponential-trapezoidal discretisation of the Mamba-3 paper is

    h_t = alpha_t h_{t-1} + (1 - lambda_t) dt_t alpha_t sum_r v_{t-1,r} k_{t-1,r}^T
          + lambda_t dt_t sum_r v_{t,r} k_{t,r}^T
    y_{t,r} = h_t q_{t,r}

:func:`recurrent_scan` runs exactly that, one token at a time. :func:`chunked_scan` computes
the same outputs with matrix products: unrolled, the input of token ``s`` reaches ``h_t``
with weight ``decay(s, t) * (lambda_s dt_s + (1 - lambda_{s+1}) dt_{s+1})`` for ``s < t``
and ``lambda_t dt_t`` for ``s = t`` (the second term is token ``s + 1``'s look-back at ``s``),
with ``decay(s, t) = exp(sum_{s < r <= t} A_r dt_r)``. Inside a chunk that is a masked
attention-like product; between chunks a ``P x N`` state per head is carried, holding the
pending look-back term of the chunk's last token so the next chunk needs nothing else.

Generation continues a prompt's state (:func:`final_state`) token by token
(:func:`continue_scan`), the mixer's ``state_cache`` holding it between forwards.

Packed documents: ``doc`` (``[B, S]``, non-decreasing document numbers, :func:`document_index`)
cuts every path between tokens of different documents, so each document starts from a zero
state with no look-back, exactly as if it were run alone. Both functions compute in float32
(or float64 when given float64).
"""

from __future__ import annotations

import math

import torch


def document_index(
    segment_ids: torch.Tensor | None, position_ids: torch.Tensor | None, shape: torch.Size | tuple[int, int]
) -> torch.Tensor | None:
    """``[B, S]`` document numbers (0, 1, ...): a document starts where the segment id changes
    or the position restarts at 0; None when neither is given (one document per row)."""
    starts: torch.Tensor | None = None
    if segment_ids is not None:
        starts = torch.zeros(shape, dtype=torch.bool, device=segment_ids.device)
        starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    if position_ids is not None:
        restart = (position_ids == 0).expand(shape).clone()
        restart[:, 0] = False
        starts = restart if starts is None else starts | restart
    if starts is None:
        return None
    return starts.long().cumsum(-1)


def segment_cumsum(x: torch.Tensor, doc: torch.Tensor | None) -> torch.Tensor:
    """Cumulative sum of ``x`` ``[B, S, ...]`` along dim 1, restarting at every document start."""
    total = x.cumsum(1)
    if doc is None:
        return total
    seq = doc.shape[1]
    pos = torch.arange(seq, device=doc.device).expand_as(doc)
    start = torch.zeros_like(doc, dtype=torch.bool)
    start[:, 1:] = doc[:, 1:] != doc[:, :-1]
    first = torch.where(start, pos, torch.zeros_like(pos)).cummax(1).values  # each token's doc start
    before = total - x  # the sum up to the token before
    index = first.view(*first.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return total - before.gather(1, index)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * A`` entries of ``x`` in adjacent pairs ``(0, 1), (2, 3), ...`` by
    the ``A`` angles of ``cos``/``sin``; the rest of the state is left as it is."""
    pairs = cos.shape[-1]
    rot, rest = x[..., : 2 * pairs], x[..., 2 * pairs :]
    even, odd = rot.unflatten(-1, (pairs, 2)).unbind(-1)
    turned = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((turned, rest), dim=-1)


def rotary_angles(raw: torch.Tensor, dt: torch.Tensor, doc: torch.Tensor | None) -> torch.Tensor:
    """The data-dependent rotary angles ``theta_t = sum_{s <= t} pi tanh(raw_s) dt_s`` per head.

    Args:
        raw: ``[B, S, A]`` angle projections (shared by the heads).
        dt: ``[B, S, H]`` step sizes.
        doc: Document numbers (the sum restarts per document) or None.

    Returns:
        ``[B, S, H, A]`` in the dtype of ``dt``.
    """
    step = math.pi * torch.tanh(raw.to(dt.dtype))[:, :, None, :] * dt[..., None]
    return segment_cumsum(step, doc)


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def recurrent_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    adt: torch.Tensor,
    dt: torch.Tensor,
    lam: torch.Tensor,
    doc: torch.Tensor | None = None,
) -> torch.Tensor:
    """The recurrence token by token (the reference :func:`chunked_scan` must equal).

    Args:
        q, k: ``[B, S, R, H, N]`` rotated C and B (queries and keys).
        v: ``[B, S, R, H, P]`` values.
        adt: ``[B, S, H]`` ``A_t dt_t`` (log of the decay, <= 0).
        dt: ``[B, S, H]`` step sizes; ``lam``: ``[B, S, H]`` trapezoid weights in [0, 1].
        doc: ``[B, S]`` document numbers, or None.

    Returns:
        ``[B, S, R, H, P]``: ``h_t q_{t,r}``.
    """
    work = _work_dtype(q)
    q, k, v, adt, dt, lam = (t.to(work) for t in (q, k, v, adt, dt, lam))
    batch, seq, _, heads, n = q.shape
    p = v.shape[-1]
    h = q.new_zeros(batch, heads, p, n)
    prev = q.new_zeros(batch, heads, p, n)
    out = []
    for t in range(seq):
        if doc is not None and t > 0:
            keep = (doc[:, t] == doc[:, t - 1]).to(work)[:, None, None, None]
            h, prev = h * keep, prev * keep
        y, h, prev = _token(h, prev, q[:, t], k[:, t], v[:, t], adt[:, t], dt[:, t], lam[:, t])
        out.append(y)
    return torch.stack(out, dim=1)


def _token(
    h: torch.Tensor,
    prev: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    adt: torch.Tensor,
    dt: torch.Tensor,
    lam: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of the recurrence: ``(y [B, R, H, P], h, this token's input sum_r v k^T)``."""
    cur = torch.einsum("brhp,brhn->bhpn", v, k)
    alpha = adt.exp()[..., None, None]
    step = dt[..., None, None]
    weight = lam[..., None, None]
    h = alpha * h + (1 - weight) * step * alpha * prev + weight * step * cur
    return torch.einsum("bhpn,brhn->brhp", h, q), h, cur


def continue_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    adt: torch.Tensor,
    dt: torch.Tensor,
    lam: torch.Tensor,
    state: torch.Tensor,
    look_back: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recurrence over new tokens of one document, from the state its earlier tokens left.

    Generation feeds one token per forward, so the token-by-token form is the whole cost.

    Args:
        q, k, v, adt, dt, lam: The new tokens, as for :func:`recurrent_scan`.
        state: ``[B, H, P, N]`` ``h`` after the last earlier token.
        look_back: ``[B, H, P, N]`` that token's input ``sum_r v k^T`` (the trapezoid's other end).

    Returns:
        ``(y [B, S, R, H, P], state, look_back)`` after the new tokens.
    """
    work = state.dtype
    q, k, v, adt, dt, lam = (t.to(work) for t in (q, k, v, adt, dt, lam))
    out = []
    for t in range(q.shape[1]):
        y, state, look_back = _token(
            state, look_back, q[:, t], k[:, t], v[:, t], adt[:, t], dt[:, t], lam[:, t]
        )
        out.append(y)
    return torch.stack(out, dim=1), state, look_back


def final_state(
    k: torch.Tensor,
    v: torch.Tensor,
    adt: torch.Tensor,
    dt: torch.Tensor,
    lam: torch.Tensor,
    doc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The state after each row's last token and that token's input, in closed form.

    ``h_T = sum_s decay(s, T) w_s sum_r v_{s,r} k_{s,r}^T`` over the tokens ``s`` of the last
    document, with ``w_s = lambda_s dt_s + (1 - lambda_{s+1}) dt_{s+1}`` (``lambda_T dt_T`` for the
    last token): what :func:`recurrent_scan` holds at the end, without the loop over tokens (a
    prompt's state for :func:`continue_scan`). ``decay(s, T)`` is summed from the end, so no large
    partial sums cancel.

    Returns:
        ``(h [B, H, P, N], look_back [B, H, P, N])`` in the scan's precision.
    """
    work = _work_dtype(k)
    k, v, adt, dt, lam = (t.to(work) for t in (k, v, adt, dt, lam))
    same = torch.ones(adt.shape[:2], dtype=work, device=adt.device)
    if doc is not None:
        same = (doc == doc[:, -1:]).to(work)
    look = torch.nn.functional.pad(((1 - lam) * dt)[:, 1:], (0, 0, 0, 1))  # token s+1's look-back at s
    weight = (lam * dt + look) * same[..., None]
    after = adt.flip(1).cumsum(1).flip(1) - adt  # sum of A dt over the tokens after s
    coef = after.exp() * weight
    h = torch.einsum("bsh,bsrhp,bsrhn->bhpn", coef, v, k)
    return h, torch.einsum("brhp,brhn->bhpn", v[:, -1], k[:, -1])


def chunked_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    adt: torch.Tensor,
    dt: torch.Tensor,
    lam: torch.Tensor,
    doc: torch.Tensor | None = None,
    *,
    chunk_size: int = 64,
) -> torch.Tensor:
    """:func:`recurrent_scan`'s outputs, ``chunk_size`` tokens at a time (same arguments)."""
    work = _work_dtype(q)
    q, k, v, adt, dt, lam = (t.to(work) for t in (q, k, v, adt, dt, lam))
    batch, seq, rank, heads, n = q.shape
    p = v.shape[-1]
    size = chunk_size
    if doc is None:
        doc = torch.zeros(batch, seq, dtype=torch.long, device=q.device)
    gamma = lam * dt
    look_back = (1 - lam) * dt
    # Token t's weight on its own input plus token t+1's look-back at it (none across documents).
    same_next = (doc[:, 1:] == doc[:, :-1]).to(work)[..., None]
    nxt = torch.nn.functional.pad(look_back[:, 1:] * same_next, (0, 0, 0, 1))
    weight = gamma + nxt
    pad = (-seq) % size
    if pad:
        # Padding tokens form a document of their own at the end, with no input.
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        adt, weight, nxt = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (adt, weight, nxt))
        doc = torch.cat((doc, (doc[:, -1:] + 1).expand(batch, pad)), dim=1)
    chunks = (seq + pad) // size

    def per_chunk(t: torch.Tensor) -> torch.Tensor:  # [B, L, R, H, X] -> [B, H, C, T * R, X]
        return t.permute(0, 3, 1, 2, 4).reshape(batch, heads, chunks, size * rank, t.shape[-1])

    qc, kc, vc = per_chunk(q), per_chunk(k), per_chunk(v)
    acs = adt.permute(0, 2, 1).reshape(batch, heads, chunks, size).cumsum(-1)
    wc = weight.permute(0, 2, 1).reshape(batch, heads, chunks, size)
    nc = nxt.permute(0, 2, 1).reshape(batch, heads, chunks, size)
    dc = doc.reshape(batch, 1, chunks, size)

    # Inside each chunk: decay(s, t) * weight_s for s < t, gamma_t on the diagonal.
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    same = (dc[..., :, None] == dc[..., None, :]) & causal
    decay = (acs[..., :, None] - acs[..., None, :]).masked_fill(~same, float("-inf")).exp()
    mix = decay * wc[..., None, :] - torch.diag_embed(nc)
    if rank > 1:
        mix = mix.repeat_interleave(rank, dim=-1).repeat_interleave(rank, dim=-2)
    y = (qc @ kc.transpose(-1, -2) * mix) @ vc

    # Each chunk's own contribution to the state at its end (pending look-back included).
    last = dc[..., -1:]
    to_end = (acs[..., -1:] - acs).exp() * (dc == last) * wc
    if rank > 1:
        to_end = to_end.repeat_interleave(rank, dim=-1)
    states = (vc * to_end[..., None]).transpose(-1, -2) @ kc  # [B, H, C, P, N]
    # Carry the state from chunk to chunk; a chunk with a document start inside drops it.
    carried = q.new_zeros(batch, heads, p, n)
    prev_last = torch.full_like(dc[..., 0, :1], -1)  # [B, 1, 1]
    inter = []
    for c in range(chunks):
        cur_doc = dc[..., c, :]  # [B, 1, T]
        reach = acs[..., c, :].exp() * (cur_doc == prev_last)
        from_start = reach.repeat_interleave(rank, dim=-1) if rank > 1 else reach
        inter.append((qc[..., c, :, :] @ carried.transpose(-1, -2)) * from_start[..., None])
        keep = (cur_doc[..., -1:] == prev_last).to(work)[..., None]  # [B, 1, 1, 1]
        carried = carried * acs[..., c, -1:, None].exp() * keep + states[..., c, :, :]
        prev_last = cur_doc[..., -1:]
    y = y + torch.stack(inter, dim=2)
    y = y.reshape(batch, heads, chunks * size, rank, p).permute(0, 2, 3, 1, 4)
    return y[:, :seq]


def heavy_tail(x: torch.Tensor) -> torch.Tensor:
    """``1 + x`` for ``x >= 0``, ``1 / (1 - x)`` below: positive, continuous, a slow tail."""
    return x.clamp_min(0) + torch.reciprocal(1 - x.clamp_max(0))


__all__ = [
    "chunked_scan",
    "continue_scan",
    "document_index",
    "final_state",
    "heavy_tail",
    "recurrent_scan",
    "rotary_angles",
    "rotate_pairs",
    "segment_cumsum",
]
