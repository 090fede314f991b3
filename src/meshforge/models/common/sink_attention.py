"""Grouped-query attention with learned per-head sink logits and optional sliding windows (gpt-oss).

A sink is one extra logit per head that joins every query's softmax and is then
dropped: the probabilities over the real keys sum to less than one, so a head can
attend "nowhere". SDPA has no such term, so the softmax is written out: scores
``q k^T * scale`` with masked positions at the dtype's lowest value, the head's
sink logit appended, the row maximum subtracted (as transformers' eager path
does), softmax, sink column dropped, product with V
(:func:`meshforge.models.common.attention.sink_attention`, reached through the shared
``attend``). Memory is ``O(S^2)`` per head, which is fine for the CPU/tiny scale this path serves.

Masks are boolean ``[B or 1, 1, S, S]`` (True = may attend), built once per
forward by the model and shared by the layers of the same kind:
:func:`causal_mask` or ``attention.segment_causal_mask`` for full attention, and
:func:`sliding_window_mask` on top for sliding layers (key j visible from query i
when ``i - window < j <= i``, transformers' rule). A query row never ends up all
masked with nothing to normalise: its own position is always visible, and the
sink keeps the denominator positive anyway.

Key/value heads are shared by query-head groups by broadcasting ``[B, KV, 1, S, D]``
against queries ``[B, KV, G, S, D]`` instead of materialising repeated K/V; query
head ``h`` belongs to group ``h // G`` as in transformers' ``repeat_kv``.

Context parallelism (``meshforge.parallel.context.apply_cp``) sets ``cp`` to the callable
that replaces ``sink_attention``: it takes this rank's ``[B, heads, S_local, D]``
queries, keys and values, the per-forward CP mask object the decoder built (in place of
the boolean mask), the sinks of this rank's heads and the layer's ``sliding_window``
(applied there in global positions), and returns the local output.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshforge.models.common.attention import AttentionBase, sink_attention
from meshforge.models.common.rope import apply_rotary


def causal_mask(seq_len: int, device: torch.device | str) -> torch.Tensor:
    """Boolean lower-triangular mask ``[1, 1, S, S]`` (key j visible from query i when ``j <= i``)."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril_()[None, None]


def sliding_window_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """Restrict a boolean ``[..., S, S]`` mask to the last ``window`` keys of every query.

    Args:
        mask: Causal (or block-diagonal causal) mask, True where attending is allowed.
        window: Keys per query including itself (transformers' ``sliding_window``).

    Returns:
        ``mask & (j > i - window)``, same shape.
    """
    seq_len = mask.shape[-1]
    index = torch.arange(seq_len, device=mask.device)
    band = index[None, :] > index[:, None] - window
    return mask & band


class SinkAttention(AttentionBase):
    """Self-attention with GQA, RoPE, projection biases and per-head sinks (transformers' ``GptOssAttention``).

    Parameter names follow transformers: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``sinks``.
    The layer's window (or None for full attention) is carried as ``sliding_window``;
    the mask passed to :meth:`forward` already encodes it, except under context
    parallelism, where the CP callable applies it.

    Args:
        hidden_size: Model width.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (divides ``num_heads``).
        head_dim: Per-head size.
        bias: Bias on the four projections (gpt-oss: ``attention_bias``, true).
        sliding_window: This layer's window, None for full attention.
        dropout: Attention-probability dropout in training mode.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool = True,
        sliding_window: int | None = None,
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
        self.sliding_window = sliding_window
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.sinks = nn.Parameter(torch.empty(num_heads))

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | object
    ) -> torch.Tensor:
        """Attend over ``x`` ``[B, S, hidden]`` with the boolean ``mask`` ``[B or 1, 1, S, S]``.

        Under context parallelism ``mask`` is the CP mask object the decoder built.
        """
        batch, seq_len, _ = x.shape
        cos, sin = rope
        q = apply_rotary(self.q_proj(x).view(batch, seq_len, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.kv_cache is not None:
            # A sliding layer's cache keeps its window; the mask the decoder got from the cache
            # covers exactly the keys returned here.
            k, v = self.kv_cache(k, v)
        # Under tensor parallelism the sinks are a DTensor sharded by head: use this rank's heads.
        sinks = self.sinks.to_local() if isinstance(self.sinks, DTensor) else self.sinks
        out = self._attend(q, k, v, mask, sinks=sinks, window=self.sliding_window)
        # [B, H, S, D] -> [B, S, H * D]; -1: under tensor parallelism the rank holds a slice of the heads.
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, sliding_window={self.sliding_window}"


__all__ = ["SinkAttention", "causal_mask", "sink_attention", "sliding_window_mask"]
