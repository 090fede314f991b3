"""Grouped-query self-attention through ``scaled_dot_product_attention``.

Three masking cases, chosen once per forward by the model:

* no ``segment_ids``: ``is_causal=True`` and no mask tensor, the fastest SDPA path;
* ``segment_ids`` [B, S] (1, 2, ... per packed document, 0 = padding): a boolean
  block-diagonal causal mask ``[B, 1, S, S]`` built once and shared by all layers,
  so no token attends across documents. Padding tokens attend to earlier padding
  tokens of the same row (segment 0 equals segment 0), so every query row keeps at
  least its diagonal and SDPA never normalises an all-masked row (which gives NaN).

Key/value heads are shared across query-head groups with SDPA's ``enable_gqa``
instead of materialising repeated K/V.

``flash = True`` (the ``kernels.use_flash_attn`` switch, CUDA only) restricts SDPA to
its flash backend with ``torch.nn.attention.sdpa_kernel``. Flash attention takes no mask
tensor, so a forward with packed documents runs plain SDPA when the switch is ``auto``
and is an error when it is ``true`` (``flash_strict``).

Context parallelism (``meshforge.parallel.context.apply_cp``) sets ``cp`` to a
callable that replaces the SDPA call: it takes this rank's queries, keys and values
(``[B, heads, S_local, head_dim]``) and the per-forward CP mask object the decoder
built, and returns the attention output for the local queries, exchanging keys and
values (or heads) with the other CP ranks itself. With ``cp = None`` (the default) the
forward is unchanged.

:func:`attend` is that dispatch (CP plan, flash switch, masked SDPA, per-head sinks) written
once: every attention module of the package (this one and its subclasses, MLA, sink
attention) projects and rotates its own q/k/v and then calls it.

``pre_tokens`` (the ``kernels.pre_tokens`` switch, MindSpeed's flash-attention argument) is a
banded causal window on every layer: query i attends keys j with ``i - pre_tokens <= j <= i``,
on top of whatever the mask already says (documents of a packed row, a family's own sliding
window: the narrower window wins). On one process :func:`attend` adds the band to the mask
(:func:`window_mask`); under context parallelism it hands the CP plan the narrower of the
two windows, applied there in global positions. Torch's flash SDPA kernel takes no window,
so a windowed forward runs masked SDPA (``use_flash_attn: auto``) or is refused (``true``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.models.common.norms import RMSNorm
from meshforge.models.common.rope import apply_rotary


def _sdpa_backend(flash: bool) -> contextlib.AbstractContextManager[None]:
    """The flash-only SDPA context when ``flash``, else a no-op context."""
    if not flash:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def sdpa_is_causal(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> bool:
    """SDPA's ``is_causal``: no mask and as many queries as keys ``[B, H, S, D]``.

    Equal lengths in training; a cached decode step (one query, every earlier key allowed) has
    no mask and must not be causal-aligned to the first key. Decided by a branch, not returned as
    the comparison: under dynamic shapes (a compiled layer seeing varying lengths) the comparison
    is a symbolic bool, which SDPA rejects, and dynamo resolves a branch on it with a guard.
    """
    if mask is None and q.shape[2] == k.shape[2]:
        return True
    return False


def segment_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask ``[B, 1, S, S]``: True where query i may attend key j.

    Args:
        segment_ids: ``[B, S]`` integers, equal ids form one document; 0 marks padding.

    Returns:
        ``(segment[i] == segment[j]) & (j <= i)``, broadcastable over heads.
    """
    seq_len = segment_ids.shape[-1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=segment_ids.device).tril_()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal)[:, None]


def window_mask(
    mask: torch.Tensor | None, q_len: int, k_len: int, pre_tokens: int, device: torch.device
) -> torch.Tensor:
    """``mask`` narrowed to the band of ``pre_tokens`` earlier keys: ``[B or 1, 1, S_q, S_k]``.

    Query i (the queries are the last ``S_q`` of the ``S_k`` key positions, so a training
    forward has ``S_q = S_k``) keeps key j when ``i - pre_tokens <= j <= i``.

    Args:
        mask: A boolean mask (True = may attend), or None for plain causal attention.
        q_len: Queries ``S_q``.
        k_len: Keys ``S_k``.
        pre_tokens: Earlier keys a query may attend besides itself.
        device: Where to build the band.

    Returns:
        ``mask & band`` (the band alone when ``mask`` is None).
    """
    q_pos = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    k_pos = torch.arange(k_len, device=device)[None, :]
    band = ((k_pos <= q_pos) & (k_pos >= q_pos - pre_tokens))[None, None]
    return band if mask is None else mask & band


def narrower_window(window: int | None, pre_tokens: int | None) -> int | None:
    """The sliding window (transformers' rule: ``i - window < j <= i``) of both limits together.

    ``pre_tokens`` earlier keys plus the query itself are a window of ``pre_tokens + 1``.
    """
    if pre_tokens is None:
        return window
    return pre_tokens + 1 if window is None else min(window, pre_tokens + 1)


def positions_from_segments(segment_ids: torch.Tensor) -> torch.Tensor:
    """Position ids ``[B, S]`` that restart at 0 at the start of every segment.

    A segment starts where the id differs from the previous token's id, so two
    adjacent documents must carry different ids (1, 2, ...), as the batch contract says.
    """
    seq_len = segment_ids.shape[-1]
    index = torch.arange(seq_len, device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - start_index


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    mask: torch.Tensor,
    *,
    scaling: float,
    dropout: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """Softmax attention with one sink logit per query head (gpt-oss).

    A sink is one extra logit per head that joins every query's softmax and is then dropped,
    so a head can attend "nowhere". SDPA has no such term, so the softmax is written out:
    scores with masked positions at the dtype's lowest value, the sink appended, the row
    maximum subtracted (as transformers' eager path does), softmax, sink column dropped.

    Args:
        q: Queries ``[B, KV, G, S, D]`` (query head ``kv * G + g``).
        k: Keys ``[B, KV, 1, S_k, D]``.
        v: Values ``[B, KV, 1, S_k, D]``.
        sinks: Sink logits ``[KV * G]``.
        mask: Boolean ``[B or 1, 1, S, S_k]``, True where the query may attend the key (``S_k = S``
            in training; the cached keys while generating).
        scaling: Multiplier of ``q k^T``.
        dropout: Dropout on the attention probabilities (training only).
        training: Whether dropout applies.

    Returns:
        ``[B, KV, G, S, D]``.
    """
    batch, kv_heads, groups, seq_len, _ = q.shape
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~mask[:, :, None], torch.finfo(scores.dtype).min)
    sink = sinks.to(scores.dtype).view(1, kv_heads, groups, 1, 1).expand(batch, -1, -1, seq_len, 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    probs = F.dropout(probs, p=dropout, training=training).to(v.dtype)
    return torch.matmul(probs, v)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | object,
    *,
    scale: float,
    dropout: float = 0.0,
    cp: Callable[..., torch.Tensor] | None = None,
    flash: bool = False,
    flash_strict: bool = False,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    pre_tokens: int | None = None,
) -> torch.Tensor:
    """The attention core every attention module calls once its q/k/v are projected and rotated.

    In order: the context-parallel plan when ``cp`` is set (it exchanges keys and values or
    heads with the other CP ranks itself); the explicit-softmax :func:`sink_attention` when
    ``sinks`` are given; else SDPA, restricted to the flash backend when ``flash`` and the
    forward has no mask (flash attention takes none; values narrower than the queries, as in
    MLA, are zero-padded to their head size for it and the padding cut from the output: zero
    value columns leave the others unchanged).

    Args:
        q: Queries ``[B, H, S_q, D]``.
        k: Keys ``[B, H_kv, S_k, D]`` (``H`` a multiple of ``H_kv``; shared by query-head groups
            with SDPA's ``enable_gqa`` instead of repeating them).
        v: Values ``[B, H_kv, S_k, D_v]``.
        mask: None for causal attention (``is_causal`` with as many queries as keys), a boolean
            ``[B or 1, 1, S_q, S_k]`` mask (True = may attend), or under context parallelism the
            CP mask object the decoder built for this forward.
        scale: Multiplier of ``q k^T``.
        dropout: Attention-probability dropout of this forward (0 outside training).
        cp: The module's context-parallel plan, or None on one process.
        flash: The ``kernels.use_flash_attn`` switch is on.
        flash_strict: It is ``true`` (not auto): a masked forward is an error, not plain SDPA.
        sinks: Per-head sink logits ``[H]`` (gpt-oss), or None for plain softmax attention.
        window: The layer's sliding window, handed to the CP plan (which applies it in global
            positions); on one process ``mask`` already encodes it.
        pre_tokens: ``kernels.pre_tokens``: earlier keys each query may attend (a band on top
            of ``mask``), or None for no such limit.

    Returns:
        ``[B, H, S_q, D_v]``.

    Raises:
        ValueError: ``attention_dropout`` under context parallelism, or
            ``kernels.use_flash_attn: true`` with a masked (packed) batch or a window.
    """
    if cp is not None:
        if dropout:
            raise ValueError(
                "attention_dropout: not supported yet with parallelism.context_parallel > 1 (set it to 0)"
            )
        window = narrower_window(window, pre_tokens)
        if sinks is None and window is None:
            return cp(q, k, v, mask, scale=scale)
        return cp(q, k, v, mask, scale=scale, sinks=sinks, window=window)
    # Only the CP plan takes its own mask object; on one process it is a tensor or None.
    assert mask is None or isinstance(mask, torch.Tensor), f"attention mask: got {type(mask).__name__}"
    # A band at least as wide as the keys cuts nothing: the mask-free causal path stays.
    if pre_tokens is not None and pre_tokens < k.shape[2] - 1:
        if flash and flash_strict:
            raise ValueError(
                f"kernels.use_flash_attn: true: torch's flash attention kernel takes no window, and "
                f"kernels.pre_tokens ({pre_tokens}) asks for one; set use_flash_attn to auto to run "
                "SDPA with the band mask"
            )
        mask = window_mask(mask, q.shape[2], k.shape[2], pre_tokens, q.device)
    if sinks is not None:
        if mask is None:
            raise ValueError(
                "sink attention needs the boolean mask of its layer (causal or sliding), got None"
            )
        # Query heads grouped by their key/value head ([B, KV, G, S, D], transformers' order);
        # keys and values broadcast over the group instead of being repeated.
        grouped = q.unflatten(1, (k.shape[1], -1))
        out = sink_attention(
            grouped,
            k.unsqueeze(2),
            v.unsqueeze(2),
            sinks,
            mask,
            scaling=scale,
            dropout=dropout,
            training=dropout > 0,
        )
        return out.flatten(1, 2)
    if flash and mask is not None and flash_strict:
        raise ValueError(
            "kernels.use_flash_attn: flash attention takes no mask, and this batch packs documents "
            "(segment_ids); set it to auto to use plain SDPA for packed batches"
        )
    flash = flash and mask is None
    # The flash kernel needs one head size for q, k and v (transformers pads MLA's values too).
    pad = q.shape[-1] - v.shape[-1] if flash else 0
    if pad > 0:
        v = F.pad(v, (0, pad))
    with _sdpa_backend(flash):
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=sdpa_is_causal(mask, q, k),
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    return out[..., : out.shape[-1] - pad] if pad > 0 else out


class AttentionBase(nn.Module):
    """What every attention module carries besides its projections: the seams others set.

    The kernel switches (``flash``, ``flash_strict``, ``pre_tokens``: ``meshforge.models.common.kernels``), the
    context-parallel plan (``cp``: ``meshforge.parallel.context.apply_cp``) and the KV cache of
    generation (``kv_cache``: ``meshforge.infer.kv_cache``), declared once, and :meth:`_attend`,
    the module's call of :func:`attend` with them.

    Args:
        scaling: Multiplier of ``q k^T``.
        dropout: Attention-probability dropout in training mode.
    """

    def __init__(self, *, scaling: float, dropout: float) -> None:
        super().__init__()
        self.scaling = scaling
        self.dropout = dropout
        # Set by the `use_flash_attn` kernel switch (meshforge.models.common.kernels).
        self.flash = False
        self.flash_strict = False
        # Set by the `pre_tokens` kernel switch: earlier keys each query may attend (None: all).
        self.pre_tokens: int | None = None
        # Set by meshforge.parallel.context.apply_cp: (q, k, v, mask, scale[, sinks, window]) -> output.
        self.cp: Callable[..., torch.Tensor] | None = None
        # Set by meshforge.infer.kv_cache during generation: (k, v) ``[B, KV, S_new, D]`` of the new
        # tokens -> (k, v) of every key this layer attends; None (training) leaves the forward as it is.
        self.kv_cache: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | object,
        *,
        sinks: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """:func:`attend` with this module's scale, dropout (in training), switches and CP plan."""
        return attend(
            q,
            k,
            v,
            mask,
            scale=self.scaling,
            dropout=self.dropout if self.training else 0.0,
            cp=self.cp,
            flash=self.flash,
            flash_strict=self.flash_strict,
            sinks=sinks,
            window=window,
            pre_tokens=self.pre_tokens,
        )


class Attention(AttentionBase):
    """Multi-head attention with grouped K/V heads, optional per-head q/k RMSNorm and RoPE.

    Module and parameter names follow transformers (``q_proj``, ``k_proj``, ``v_proj``,
    ``o_proj``, ``q_norm``, ``k_norm``) so state dicts load without renaming.

    Args:
        hidden_size: Model width.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (divides ``num_heads``).
        head_dim: Per-head size, independent of ``hidden_size / num_heads``.
        bias: Bias on the four projections.
        qk_norm: Apply RMSNorm over ``head_dim`` to queries and keys before RoPE (Qwen3).
        norm_eps: Epsilon of the q/k norms.
        dropout: Attention-probability dropout in training mode.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool = False,
        qk_norm: bool = True,
        norm_eps: float = 1e-6,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(scaling=head_dim**-0.5, dropout=dropout)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | object,
    ) -> torch.Tensor:
        """Attend over ``x`` ([B, S, hidden]).

        Args:
            x: Normalised hidden states.
            rope: ``(cos, sin)`` from :class:`~meshforge.models.common.rope.RotaryEmbedding`.
            mask: Boolean ``[B, 1, S, S]`` mask, or None for plain causal attention; under
                context parallelism the CP mask object the decoder built for this forward.

        Returns:
            ``[B, S, hidden]`` after the output projection.
        """
        batch, seq_len, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.q_proj(x).view(batch, seq_len, -1, self.head_dim)
        k = self.k_proj(x).view(batch, seq_len, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq_len, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm)
            q = self.q_norm(q)
            k = self.k_norm(k)
        cos, sin = rope
        q = apply_rotary(q, cos, sin).transpose(1, 2)
        k = apply_rotary(k, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        if self.kv_cache is not None:
            k, v = self.kv_cache(k, v)
        out = self._attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))
