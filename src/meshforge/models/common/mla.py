"""Multi-head latent attention (MLA, DeepSeek-V2/V3) through ``scaled_dot_product_attention``.

Module and parameter names are those of transformers' ``DeepseekV3Attention`` 5.24:

* queries: ``q_proj`` (``q_lora_rank`` None) or the low-rank path
  ``q_b_proj(q_a_layernorm(q_a_proj(x)))``; each head is ``qk_nope_head_dim`` positionless
  dims followed by ``qk_rope_head_dim`` rotated ones;
* keys/values: ``kv_a_proj_with_mqa`` gives a ``kv_lora_rank`` latent (normalised by
  ``kv_a_layernorm``, expanded per head by ``kv_b_proj`` into the positionless key part and
  the value) plus one rotated key part of ``qk_rope_head_dim`` shared by all heads;
* ``o_proj`` maps ``num_heads * v_head_dim`` back to the model width.

The softmax scale is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`` unless the family
passes its own (``softmax_scale``: DeepSeek-V3's YaRN ``mscale`` correction). Masking is the same as
:mod:`meshforge.models.common.attention`: ``is_causal`` without a mask, else the boolean
block-diagonal causal mask of packed segments.

Interleaved RoPE (``rope_interleave``, DeepSeek's layout): the rotated dims are pairs
``(x0, x1), (x2, x3), ...``, each turned by one frequency; transformers writes the result
de-interleaved (all first members of a pair, then all second members). Queries and keys get
the same permutation, so the attention scores are those of the interleaved rotation.

``flash = True`` (the ``kernels.use_flash_attn`` switch, CUDA only) restricts SDPA to its flash
backend as :class:`~meshforge.models.common.attention.Attention` does (packed batches: plain
SDPA, or an error when ``flash_strict``); the shared core
(:func:`~meshforge.models.common.attention.attend`) zero-pads the values, narrower than
``qk_nope_head_dim + qk_rope_head_dim``, to the flash kernel's one head size and cuts the
padding from the output, as transformers does for MLA under flash attention.

Context parallelism (``meshforge.parallel.context.apply_cp``) sets ``cp`` to the callable
that replaces the SDPA call, as on :class:`~meshforge.models.common.attention.Attention`:
it takes this rank's ``[B, heads, S_local, *]`` queries, keys and values (values of their
own head size) and the decoder's per-forward CP mask, and returns the local output. The
decoder passes global positions, so the (interleaved) RoPE is that of one process.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshforge.models.common.attention import AttentionBase
from meshforge.models.common.norms import RMSNorm
from meshforge.models.common.rope import apply_rotary


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ([B, S, H, D]) with pairs ``(x[2i], x[2i+1])``, output de-interleaved.

    ``cos``/``sin`` are ``[B or 1, S, D]`` as :class:`~meshforge.models.common.rope.RotaryEmbedding`
    returns them (``cat(freqs, freqs)``), so their first half holds one angle per pair.
    Returns ``cat(x_even * cos - x_odd * sin, x_odd * cos + x_even * sin)``, the exact
    arithmetic of transformers' ``apply_rotary_pos_emb_interleave``.
    """
    half = cos.shape[-1] // 2
    cos = cos[..., :half].unsqueeze(2)
    sin = sin[..., :half].unsqueeze(2)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


class MultiHeadLatentAttention(AttentionBase):
    """DeepSeek multi-head latent attention; see the module docstring.

    Args:
        hidden_size: Model width.
        num_heads: Attention heads (keys and values are expanded to all of them).
        q_lora_rank: Rank of the query down-projection, or None for a full ``q_proj``.
        kv_lora_rank: Rank of the key/value latent.
        qk_nope_head_dim: Per-head query/key dims without position encoding.
        qk_rope_head_dim: Per-head query/key dims with rotary position encoding.
        v_head_dim: Per-head value size.
        bias: Bias on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` (``attention_bias``).
        rope_interleave: Rotate interleaved pairs (DeepSeek's layout) instead of halves.
        norm_eps: Epsilon of the latent RMSNorms (transformers leaves them at 1e-6).
        dropout: Attention-probability dropout in training mode.
        softmax_scale: Scale of the attention logits; None means ``qk_head_dim ** -0.5``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        bias: bool = False,
        rope_interleave: bool = True,
        norm_eps: float = 1e-6,
        dropout: float = 0.0,
        softmax_scale: float | None = None,
    ) -> None:
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        super().__init__(
            scaling=qk_head_dim**-0.5 if softmax_scale is None else softmax_scale, dropout=dropout
        )
        self.num_heads = num_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.rope_interleave = rope_interleave
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)
        # Set by meshforge.infer.kv_cache for the compressed cache: (normed latent ``[B, S_new, rank]``,
        # rotated key part ``[B, S_new, 1, rope]``) of the new tokens -> the same of every token so far.
        self.latent_cache: (
            Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None
        ) = None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | object,
    ) -> torch.Tensor:
        """Attend over ``x`` ([B, S, hidden]).

        Args:
            x: Normalised hidden states.
            rope: ``(cos, sin)`` of width ``qk_rope_head_dim`` for these positions.
            mask: Boolean ``[B, 1, S, S]`` mask, or None for plain causal attention; under
                context parallelism the CP mask object the decoder built for this forward.

        Returns:
            ``[B, S, hidden]`` after the output projection.
        """
        batch, seq_len, _ = x.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, seq_len, self.num_heads, self.qk_head_dim)
        q_pass, q_rot = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rot = k_rot.view(batch, seq_len, 1, self.qk_rope_head_dim)
        cos, sin = rope
        rotate = apply_rotary_interleaved if self.rope_interleave else apply_rotary
        q_rot, k_rot = rotate(q_rot, cos, sin), rotate(k_rot, cos, sin)

        latent = self.kv_a_layernorm(latent)
        if self.latent_cache is not None:
            # Compressed cache: the normed latent and the shared rotated key part of every token so
            # far; keys and values are re-expanded from them (the same arithmetic as without cache).
            latent, k_rot = self.latent_cache(latent, k_rot)
        kv = self.kv_b_proj(latent)
        kv = kv.view(batch, latent.shape[1], self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_pass, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        # The rotated key part is one head shared by all: broadcast it, no copy until the cat.
        k_rot = k_rot.expand(-1, -1, self.num_heads, -1)
        q = torch.cat((q_pass, q_rot), dim=-1).transpose(1, 2)
        k = torch.cat((k_pass, k_rot), dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)
        if self.kv_cache is not None:
            k, v = self.kv_cache(k, v)
        out = self._attend(q, k, v, mask)
        # -1: under tensor parallelism the rank holds a slice of the heads.
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope={self.qk_nope_head_dim}, qk_rope={self.qk_rope_head_dim}, v={self.v_head_dim}, "
            f"interleave={self.rope_interleave}"
        )


__all__ = ["MultiHeadLatentAttention", "apply_rotary_interleaved"]
