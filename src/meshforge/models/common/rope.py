"""Rotary position embedding (transformers' RoPE types) computed from position ids.

Built RoPE types (transformers' ``rope_parameters["rope_type"]``): ``default`` (plain
``1 / theta^(2i/d)`` frequencies) and ``llama3`` (Llama 3.1's frequency-dependent
scaling for long context). Other types are refused by name rather than silently
treated as ``default``. Neither built type rescales cos/sin (transformers'
``attention_scaling`` is 1.0 for both), so only the inverse frequencies differ.

cos/sin are derived from ``position_ids`` rather than from the sequence index, so
packed rows (positions restarting per document) and arbitrary offsets work. The
module holds no parameters or buffers: a model built on the meta device and
materialised with ``to_empty`` needs no extra re-initialisation step, and
checkpoints carry nothing derived. For the common case (no ``position_ids``) the
cos/sin table for ``0..S-1`` is cached per device and dtype and sliced, instead of
being recomputed on every forward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from meshforge.models.common.options import as_float, as_int

#: RoPE types (transformers' ``rope_type``) that :func:`inv_freq_from_parameters` builds.
ROPE_TYPES: tuple[str, ...] = ("default", "llama3")
#: Keys a ``llama3`` parameter dict must carry besides ``rope_type`` and ``rope_theta``.
LLAMA3_KEYS: tuple[str, ...] = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies ``1 / theta^(2i/d)`` in float32, as transformers computes them.

    Args:
        head_dim: Rotated dimension (the attention head size); must be even.
        theta: RoPE base wavelength (``rope_theta``).

    Returns:
        A float32 CPU tensor of shape ``[head_dim // 2]``.
    """
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))


def llama3_inv_freq(
    head_dim: int,
    theta: float,
    *,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    """Llama 3.1 inverse frequencies: the default ones rescaled by wavelength band.

    With ``L = original_max_position_embeddings``, a frequency whose wavelength
    ``2 pi / f`` is shorter than ``L / high_freq_factor`` is kept, one longer than
    ``L / low_freq_factor`` is divided by ``factor``, and the ones in between are
    interpolated linearly in ``L / wavelength``. The float32 operations follow
    transformers' ``_compute_llama3_parameters`` in the same order, so the result is
    bitwise the reference's.

    Args:
        head_dim: Rotated dimension (even).
        theta: RoPE base wavelength.
        factor: Context-extension factor (8 for Llama 3.1).
        low_freq_factor: Defines the long-wavelength edge ``L / low_freq_factor``.
        high_freq_factor: Defines the short-wavelength edge ``L / high_freq_factor``;
            must differ from ``low_freq_factor``.
        original_max_position_embeddings: Pre-training context length ``L``.

    Returns:
        A float32 CPU tensor of shape ``[head_dim // 2]``.
    """
    if high_freq_factor == low_freq_factor:
        # The interpolation divides by their difference.
        raise ValueError(
            f"rope_parameters.high_freq_factor: must differ from low_freq_factor ({low_freq_factor}), "
            f"got {high_freq_factor}"
        )
    inv_freq = default_inv_freq(head_dim, theta)
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_type_of(rope_parameters: Mapping[str, object]) -> str:
    """The RoPE type of a transformers parameter dict (``rope_type``, legacy ``type``, else default)."""
    return str(rope_parameters.get("rope_type", rope_parameters.get("type", "default")))


def inv_freq_from_parameters(
    head_dim: int, rope_parameters: Mapping[str, object], *, theta: float | None = None
) -> torch.Tensor:
    """Inverse frequencies for a transformers ``rope_parameters`` dict.

    Args:
        head_dim: Rotated dimension (even).
        rope_parameters: ``{"rope_type": ..., "rope_theta": ..., <type-specific keys>}``
            as transformers 5.24 spells it (``type`` accepted for ``rope_type``).
        theta: Base wavelength used when the dict has no ``rope_theta``.

    Returns:
        A float32 CPU tensor of shape ``[head_dim // 2]``.

    Raises:
        ValueError: For a RoPE type that is not built (``not supported yet: rope_type X``),
            a missing ``rope_theta`` or llama3 key, or ``partial_rotary_factor`` other than 1.
    """
    rope_type = rope_type_of(rope_parameters)
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_parameters.rope_type: not supported yet: rope_type {rope_type} (built: {', '.join(ROPE_TYPES)})"
        )
    partial = rope_parameters.get("partial_rotary_factor", 1.0)
    if partial is not None and as_float(partial) != 1.0:
        raise ValueError(f"rope_parameters.partial_rotary_factor: not supported yet: {partial} (only 1.0)")
    base = rope_parameters.get("rope_theta", theta)
    if base is None:
        raise ValueError("rope_parameters.rope_theta: missing (the RoPE base wavelength, e.g. 10000.0)")
    if rope_type == "default":
        return default_inv_freq(head_dim, as_float(base))
    missing = [key for key in LLAMA3_KEYS if rope_parameters.get(key) is None]
    if missing:
        raise ValueError(
            f"rope_parameters.{missing[0]}: required for rope_type llama3 (needs {', '.join(LLAMA3_KEYS)})"
        )
    return llama3_inv_freq(
        head_dim,
        as_float(base),
        factor=as_float(rope_parameters["factor"]),
        low_freq_factor=as_float(rope_parameters["low_freq_factor"]),
        high_freq_factor=as_float(rope_parameters["high_freq_factor"]),
        original_max_position_embeddings=as_int(rope_parameters["original_max_position_embeddings"]),
    )


class RotaryEmbedding(nn.Module):
    """Produces ``(cos, sin)`` of shape ``[B or 1, S, head_dim]`` for given positions.

    ``RotaryEmbedding(head_dim, theta)`` is the default RoPE; passing
    ``rope_parameters`` (transformers' dict) selects the type and its scaling keys,
    with ``theta`` as the base when the dict has no ``rope_theta``.

    Args:
        head_dim: Attention head size (even).
        theta: RoPE base wavelength.
        rope_parameters: Optional transformers ``rope_parameters`` dict.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float | None = None,
        *,
        rope_parameters: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        if rope_parameters is None:
            if theta is None:
                raise ValueError("RotaryEmbedding: give theta or rope_parameters")
            self.rope_type = "default"
            self.theta = float(theta)
            self._inv_freq = default_inv_freq(head_dim, self.theta)
        else:
            self.rope_type = rope_type_of(rope_parameters)
            self._inv_freq = inv_freq_from_parameters(head_dim, rope_parameters, theta=theta)
            self.theta = as_float(rope_parameters.get("rope_theta", theta))
        # (device, dtype) -> (cos, sin) for positions 0..len-1; grown on demand.
        self._table: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Same arithmetic as transformers (float32 product, then cos/sin, then cast) so
        # the result is bitwise identical to the reference for the same positions.
        inv_freq = self._inv_freq.to(positions.device)
        freqs = positions[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        position_ids: torch.Tensor | None,
        *,
        seq_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(cos, sin)`` for ``position_ids`` ([B, S]) or for ``0..seq_len-1``.

        Args:
            position_ids: Integer positions ``[B, S]``, or None for ``arange(seq_len)``.
            seq_len: Sequence length S (used when ``position_ids`` is None).
            device: Device of the activations.
            dtype: Compute dtype of the activations.

        Returns:
            cos and sin, each ``[B, S, head_dim]`` (``[1, S, head_dim]`` without position ids).
        """
        if position_ids is not None:
            return self._cos_sin(position_ids, dtype)
        key = (torch.device(device), dtype)
        cached = self._table.get(key)
        if cached is None or cached[0].shape[0] < seq_len or cached[0].device.type == "meta":
            length = max(seq_len, 2 * cached[0].shape[0] if cached is not None else seq_len)
            positions = torch.arange(length, device=device)
            cached = self._cos_sin(positions, dtype)
            if device.type != "meta":
                self._table[key] = cached
        return cached[0][None, :seq_len], cached[1][None, :seq_len]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ([B, S, H, D]) by ``cos``/``sin`` ([B or 1, S, D]), "rotate half" convention.

    Computes ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``,
    the layout transformers' Llama/Qwen checkpoints expect.
    """
    cos = cos.unsqueeze(2)
    sin = sin.unsqueeze(2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_partial_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    """:func:`apply_rotary` on the first ``rotary_dim`` dims of each head, the rest passed through.

    The partial RoPE of ``partial_rotary_factor`` (MiniMax-M2, Qwen3-Next, Step-3.5): ``cos``/``sin``
    are ``rotary_dim`` wide. With ``rotary_dim`` equal to the head size it is :func:`apply_rotary`.
    """
    if rotary_dim == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat([apply_rotary(rot, cos, sin), rest], dim=-1)
