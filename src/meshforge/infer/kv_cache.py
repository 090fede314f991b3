"""A key/value cache for the built-in families' shared attention block, attached only while generating.

``Attention.kv_cache`` and ``DecoderModel.decode_mask`` are hooks that are None in training, so the
training forward (and its numerics) is untouched. While a :class:`KVCache` is attached, each
attention layer writes the keys and values of the new tokens into a preallocated buffer
``[B, kv_heads, capacity, head_dim]`` and attends over every slot written so far; the decoder asks
the cache for one boolean mask per forward: query ``i`` (absolute slot ``t``) sees slot ``j`` when
``j <= t`` and slot ``j`` holds a real token (left padding is never attended). A padding query sees
itself as well, so no softmax row is empty (an empty row gives NaN, and a NaN key or value would
reach real tokens through ``0 * NaN``).

Multi-head latent attention (deepseek_v3) caches its full per-head keys and values the same way (not
the compressed latent: simpler, more memory). Families with sink attention and sliding windows
(gpt_oss) or Gated DeltaNet layers (qwen3_next) have no cache here: :func:`cache_support` names the reason and the
command falls back to transformers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from meshforge.models.common.attention import Attention
from meshforge.models.common.causal_lm import DecoderModel
from meshforge.models.common.mla import MultiHeadLatentAttention

#: Families whose decoder layers all use the shared ``Attention`` block or multi-head latent attention.
CACHED_FAMILIES: tuple[str, ...] = ("qwen3", "llama", "qwen3_moe", "deepseek_v3")
_CACHED_BLOCKS = (Attention, MultiHeadLatentAttention)


def cache_support(model: nn.Module) -> str | None:
    """None when meshforge's cached decoder can run ``model``, else the reason it cannot."""
    family = getattr(type(model), "family", None)
    if family not in CACHED_FAMILIES:
        return f"{family or type(model).__name__} has no meshforge KV cache (built for {', '.join(CACHED_FAMILIES)})"
    inner = getattr(model, "model", None)
    if not isinstance(inner, DecoderModel):
        return f"{type(model).__name__}: the inner model is not a DecoderModel"
    if any(type(m) not in _CACHED_BLOCKS for m in _attention_layers(model)):
        return f"{type(model).__name__}: an attention layer is neither the shared Attention block nor MLA"
    return None


def _attention_layers(model: nn.Module) -> list[nn.Module]:
    return [layer.self_attn for layer in model.model.layers]  # type: ignore[union-attr]


class _LayerCache:
    """One layer's buffers; ``__call__`` is the ``Attention.kv_cache`` hook."""

    def __init__(self, owner: KVCache) -> None:
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, new = self.owner.length, k.shape[2]
        if self.k is None or self.v is None:
            # Keys and values may differ in width (MLA: qk_head_dim vs v_head_dim).
            capacity = self.owner.capacity
            self.k = k.new_empty((*k.shape[:2], capacity, k.shape[3]))
            self.v = v.new_empty((*v.shape[:2], capacity, v.shape[3]))
        self.k[:, :, start : start + new] = k
        self.v[:, :, start : start + new] = v
        return self.k[:, :, : start + new], self.v[:, :, : start + new]


class KVCache:
    """Keys, values and the padding mask of one batch of sequences being generated.

    Args:
        attention_mask: ``[B, S_prompt]`` bool, False on left padding.
        capacity: Most tokens a row will hold (prompt plus new tokens).
    """

    def __init__(self, attention_mask: torch.Tensor, capacity: int) -> None:
        self.capacity = capacity
        self.length = 0  # slots already written (before the current forward)
        self.valid = torch.zeros(
            attention_mask.shape[0], capacity, dtype=torch.bool, device=attention_mask.device
        )
        self.valid[:, : attention_mask.shape[1]] = attention_mask
        self.no_padding = bool(attention_mask.all())
        self.layers: list[_LayerCache] = []

    def mask(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """``DecoderModel.decode_mask`` hook: ``[B, 1, S_new, length + S_new]`` for this forward.

        None when no row has padding and the forward is the prompt (plain causal) or one new token
        (every key allowed): SDPA then takes its mask-free kernels (flash on CUDA).
        """
        new = input_ids.shape[1]
        total = self.length + new
        if (self.length == 0 or new == 1) and self.no_padding:
            return None
        query = torch.arange(self.length, total, device=input_ids.device)[:, None]
        key = torch.arange(total, device=input_ids.device)[None, :]
        allowed = (key <= query)[None] & self.valid[:, None, :total]
        allowed |= (key == query)[None]
        return allowed[:, None]

    def advance(self, new: int) -> None:
        """Count ``new`` slots as written (after a forward)."""
        self.length += new

    @contextmanager
    def attached(self, model: nn.Module) -> Iterator[None]:
        """Hook this cache into ``model``'s attention layers and decoder for the duration."""
        inner = model.model
        assert isinstance(inner, DecoderModel)
        layers = _attention_layers(model)
        if not self.layers:
            self.layers = [_LayerCache(self) for _ in layers]
        for attn, cache in zip(layers, self.layers, strict=True):
            attn.kv_cache = cache  # type: ignore[assignment]
        inner.decode_mask = self.mask
        try:
            yield
        finally:
            inner.decode_mask = None
            for attn in layers:
                attn.kv_cache = None  # type: ignore[assignment]
