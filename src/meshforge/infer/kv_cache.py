"""The generation cache of every built-in family, attached only while generating.

The hooks it fills are None in training, so the training forward (and its numerics) is untouched:
``kv_cache`` on the attention blocks (shared ``Attention``, Qwen3-Next's gated attention, gpt-oss'
sink attention, MLA's full mode), ``latent_cache`` on MLA, ``state_cache`` on Gated DeltaNet, and
``decode_mask`` on the inner model. Per layer kind:

* full attention: keys and values of every slot in a preallocated ``[B, kv_heads, capacity, D]``;
* sliding-window attention (gpt-oss and step3p5 ``sliding_attention``: an attention whose
  ``sliding_window`` attribute is an int): only the last ``sliding_window`` slots (a query at slot
  ``t`` sees keys ``t - window < j <= t``), so the layer's cache stops growing;
* multi-head latent attention (deepseek_v3), ``compressed`` (default): the normed ``kv_latent``
  (``kv_lora_rank``) and the rotated key part shared by the heads (``qk_rope_head_dim``) per
  token, re-expanded through ``kv_b_proj`` at every forward; else the full per-head keys/values.
  Re-expansion (rather than absorbing ``kv_b_proj`` into the query and output) keeps the
  arithmetic of the uncached forward, so tokens equal transformers'; its price is one
  ``[T, rank] x [rank, heads * (nope + v)]`` matmul per layer and step over the ``T`` cached
  tokens, which the absorbed form would avoid for long contexts;
* a recurrent mixer (qwen3_next's Gated DeltaNet on its ``linear_attention`` layers, mamba3's
  mixer on every layer): the state its family's spec makes (``KVCacheModules.new_state``; the
  DeltaNet's conv window and ``[Hv, Dk, Dv]`` rule state, Mamba-3's ``[H, P, N]`` SSM state with
  the pending look-back term and the rotary angle).

Which families have a cache, their inner models and their recurrent mixers are facts of each
family's spec (``FamilySpec.kv_cache``); this module imports no family's code.

The decoder asks the cache for the mask of each forward: query ``i`` (absolute slot ``t``) sees slot
``j`` when ``j <= t`` (and ``j > t - window`` on a sliding layer) and slot ``j`` holds a real token
(left padding is never attended). A padding query sees itself as well, so no softmax row is empty (an
empty row gives NaN, and a NaN key or value would reach real tokens through ``0 * NaN``).
:meth:`KVCache.reorder` keeps the rows a beam search continues.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from meshforge.models.common.attention import Attention
from meshforge.models.common.mla import MultiHeadLatentAttention
from meshforge.models.common.sink_attention import SinkAttention
from meshforge.models.registry import kv_cache_families, spec_of_model
from meshforge.models.spec import KVCacheModules, RecurrentState

# The hooks a family's ``KVCacheModules`` classes carry (the classes are known only through the
# spec, so the hooks are set by name).
_MASK_HOOK = "decode_mask"  # on KVCacheModules.decoders
_STATE_HOOK = "state_cache"  # on KVCacheModules.recurrent

#: The shared attention modules; every cached family's attentions are among them.
_ATTENTIONS = (Attention, MultiHeadLatentAttention, SinkAttention)


def _modules(model: nn.Module) -> KVCacheModules | None:
    """The cache modules the spec of ``model``'s family names, or None (no cache for it)."""
    spec = spec_of_model(model)
    return spec.kv_cache() if spec is not None and spec.kv_cache is not None else None


def cache_support(model: nn.Module) -> str | None:
    """None when meshforge's cached decoder can run ``model``, else the reason it cannot."""
    modules = _modules(model)
    if modules is None:
        family = getattr(type(model), "family", None)
        built = ", ".join(kv_cache_families())
        return f"{family or type(model).__name__} has no meshforge KV cache (built for {built})"
    inner = getattr(model, "model", None)
    if not isinstance(inner, modules.decoders):
        return f"{type(model).__name__}: the inner model is not one the cache knows"
    mixers = _mixers(model, modules)
    if any(not isinstance(m, _ATTENTIONS + modules.recurrent) for m in mixers):
        return f"{type(model).__name__}: a layer's token mixer has no cache"
    if not modules.masks_by_layer_kind and any(_window(m) is not None for m in mixers):
        # One mask for every layer cannot be both the full and the windowed one.
        return f"{type(model).__name__}: a sliding-window layer in a decoder that takes one mask"
    return None


def _window(mixer: nn.Module | None) -> int | None:
    """The window of a sliding attention layer (its int ``sliding_window``), else None."""
    window = getattr(mixer, "sliding_window", None)
    return window if isinstance(mixer, _ATTENTIONS) and isinstance(window, int) else None


def _mixers(model: nn.Module, modules: KVCacheModules) -> list[nn.Module | None]:
    """Each decoder layer's token mixer: its first ``mixer_attributes`` entry that is a module."""
    mixers: list[nn.Module | None] = []
    for layer in model.model.layers:  # type: ignore[union-attr]
        found = (getattr(layer, name, None) for name in modules.mixer_attributes)
        mixers.append(next((m for m in found if isinstance(m, nn.Module)), None))
    return mixers


class _FullCache:
    """Every slot's keys and values; ``__call__`` is the ``kv_cache`` hook."""

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

    def reorder(self, index: torch.Tensor) -> None:
        if self.k is not None and self.v is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)


class _WindowCache(_FullCache):
    """A sliding layer's last ``window`` slots (the keys its next queries can still see)."""

    def __init__(self, owner: KVCache, window: int) -> None:
        super().__init__(owner)
        self.window = window

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is not None and self.v is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        keep = min(self.window, k.shape[2])
        self.k, self.v = k[:, :, k.shape[2] - keep :], v[:, :, v.shape[2] - keep :]
        return k, v


class _LatentCache(_FullCache):
    """MLA's compressed cache: normed latent ``[B, capacity, rank]`` and rotated key ``[B, capacity, 1, rope]``."""

    def __call__(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, new = self.owner.length, latent.shape[1]
        if self.k is None or self.v is None:
            capacity = self.owner.capacity
            self.k = latent.new_empty((latent.shape[0], capacity, latent.shape[2]))
            self.v = k_rot.new_empty((k_rot.shape[0], capacity, *k_rot.shape[2:]))
        self.k[:, start : start + new] = latent
        self.v[:, start : start + new] = k_rot
        return self.k[:, : start + new], self.v[:, : start + new]


class KVCache:
    """Cached keys/values (or latents, or recurrent states) and the padding mask of one batch.

    Args:
        attention_mask: ``[B, S_prompt]`` bool, False on left padding.
        capacity: Most tokens a row will hold (prompt plus new tokens).
        compressed_mla: Cache MLA's latent and rotated key instead of the per-head keys/values.
    """

    def __init__(self, attention_mask: torch.Tensor, capacity: int, *, compressed_mla: bool = True) -> None:
        self.capacity = capacity
        self.compressed_mla = compressed_mla
        self.length = 0  # slots already written (before the current forward)
        self.valid = torch.zeros(
            attention_mask.shape[0], capacity, dtype=torch.bool, device=attention_mask.device
        )
        self.valid[:, : attention_mask.shape[1]] = attention_mask
        self.no_padding = bool(attention_mask.all())
        self.layers: list[_FullCache] = []
        self.states: list[RecurrentState] = []
        self.windows: set[int] = set()

    def _mask(self, new: int, device: torch.device, window: int | None = None) -> torch.Tensor:
        """``[B, 1, new, keys]`` over the slots a layer attends (the last ``window`` held ones when given)."""
        total = self.length + new
        first = 0 if window is None else max(0, self.length - window)
        query = torch.arange(self.length, total, device=device)[:, None]
        key = torch.arange(first, total, device=device)[None, :]
        allowed = key <= query
        if window is not None:
            allowed &= key > query - window
        allowed = allowed[None] & self.valid[:, None, first:total]
        allowed |= (key == query)[None]
        return allowed[:, None]

    def mask(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The ``decode_mask`` hook of an inner model with one mask: ``[B, 1, S_new, length + S_new]``.

        None when no row has padding and the forward is the prompt (plain causal) or one new token
        (every key allowed): SDPA then takes its mask-free kernels (flash on CUDA).
        """
        new = input_ids.shape[1]
        self._state_masks(new)
        if (self.length == 0 or new == 1) and self.no_padding:
            return None
        return self._mask(new, input_ids.device)

    def masks(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The ``decode_mask`` hook of an inner model with one mask per layer kind (full, sliding)."""
        new = input_ids.shape[1]
        self._state_masks(new)
        out = {"full_attention": self._mask(new, input_ids.device)}
        for window in self.windows:
            out["sliding_attention"] = self._mask(new, input_ids.device, window)
        return out

    def _state_masks(self, new: int) -> None:
        if not self.states:
            return
        real = self.valid[:, self.length : self.length + new]
        token_mask = None if bool(real.all()) else real
        for state in self.states:
            state.token_mask = token_mask

    def advance(self, new: int) -> None:
        """Count ``new`` slots as written (after a forward)."""
        self.length += new

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` ``[B]`` (each row continues the row it names; beam search)."""
        self.valid = self.valid.index_select(0, index)
        for layer in self.layers:
            layer.reorder(index)
        for state in self.states:
            state.reorder(index)

    def nbytes(self) -> int:
        """Bytes the layers' caches hold (recurrent states included, the padding mask not)."""
        return sum(layer.nbytes() for layer in self.layers) + sum(state.nbytes() for state in self.states)

    def _build(self, mixers: list[nn.Module], modules: KVCacheModules) -> None:
        for mixer in mixers:
            if isinstance(mixer, modules.recurrent):
                assert modules.new_state is not None, "KVCacheModules.recurrent needs new_state"
                self.states.append(modules.new_state())
            elif (window := _window(mixer)) is not None:
                self.windows.add(window)
                self.layers.append(_WindowCache(self, window))
            elif isinstance(mixer, MultiHeadLatentAttention) and self.compressed_mla:
                self.layers.append(_LatentCache(self))
            else:
                self.layers.append(_FullCache(self))
        if len(self.windows) > 1:
            raise ValueError(f"sliding_window: the layers use several windows {sorted(self.windows)}")

    @contextmanager
    def attached(self, model: nn.Module) -> Iterator[None]:
        """Hook this cache into ``model``'s token mixers and decoder for the duration."""
        modules = _modules(model)
        assert modules is not None and cache_support(model) is None, cache_support(model)
        inner = model.model
        mixers = [m for m in _mixers(model, modules) if m is not None]
        if not self.layers and not self.states:
            self._build(mixers, modules)
        layers, states = iter(self.layers), iter(self.states)
        for mixer in mixers:
            if isinstance(mixer, modules.recurrent):
                setattr(mixer, _STATE_HOOK, next(states))
            elif isinstance(mixer, MultiHeadLatentAttention) and self.compressed_mla:
                mixer.latent_cache = next(layers)
            else:
                mixer.kv_cache = next(layers)  # type: ignore[assignment]
        setattr(inner, _MASK_HOOK, self.masks if modules.masks_by_layer_kind else self.mask)
        try:
            yield
        finally:
            setattr(inner, _MASK_HOOK, None)
            for mixer in mixers:
                if isinstance(mixer, modules.recurrent):
                    setattr(mixer, _STATE_HOOK, None)
                elif isinstance(mixer, MultiHeadLatentAttention):
                    mixer.latent_cache = None
                    mixer.kv_cache = None
                else:
                    mixer.kv_cache = None  # type: ignore[assignment]
