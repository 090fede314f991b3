"""YaRN rotary embedding (transformers' ``rope_type: yarn``): blended frequencies and a cos/sin gain.

YaRN extends the context of a RoPE model by interpolating the low frequencies
(dividing them by ``factor``), keeping the high ones, and ramping linearly between
the two over a band of dimensions chosen by ``beta_fast``/``beta_slow``; it also
multiplies cos and sin by an "attention factor" (``0.1 ln(factor) + 1`` unless
given), which scales every attention logit by its square. gpt-oss ships it on by
default (factor 32 over an original 4096 context).

This lives beside ``rope.py`` instead of inside it so the RoPE types built there
(``default``, ``llama3``, which have no cos/sin gain) keep their behaviour and
refusals unchanged; :class:`YarnRotaryEmbedding` reuses ``RotaryEmbedding``'s
position handling and cache.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from meshforge.models.common.arg_rules import YARN_KEYS
from meshforge.models.common.options import as_float, as_int
from meshforge.models.common.rope import RotaryEmbedding


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(
    head_dim: int,
    theta: float,
    *,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
    attention_factor: float | None = None,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies and cos/sin gain, with transformers' float32 arithmetic order.

    Args:
        head_dim: Rotated dimension (even).
        theta: RoPE base wavelength.
        factor: Context-extension factor (interpolated frequencies are divided by it).
        original_max_position_embeddings: Pre-training context ``L`` that sets the ramp band.
        beta_fast: Rotations at the high-frequency edge of the ramp (falsy means 32, as transformers).
        beta_slow: Rotations at the low-frequency edge (falsy means 1).
        truncate: Round the band edges outward to whole dimensions.
        attention_factor: The cos/sin gain; None derives it from ``factor`` (and ``mscale`` /
            ``mscale_all_dim`` when both are set).
        mscale: DeepSeek-style numerator scale of the derived gain.
        mscale_all_dim: DeepSeek-style denominator scale of the derived gain.

    Returns:
        ``(inv_freq, attention_scaling)``: a float32 CPU tensor ``[head_dim // 2]`` and a float.
    """
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
        else:
            attention_factor = _mscale(factor)
    beta_fast = beta_fast or 32
    beta_slow = beta_slow or 1

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return (head_dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid dividing by zero in the ramp
    # Explicit CPU: the model may be built under a meta-device context, and these are not buffers.
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device="cpu").to(dtype=torch.float) / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    keep = 1 - ramp  # weight of the original (extrapolated) frequency
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, float(attention_factor)


def _optional_float(value: object) -> float | None:
    return None if value is None else as_float(value)


def yarn_from_parameters(
    head_dim: int,
    rope_parameters: Mapping[str, object],
    *,
    theta: float | None = None,
    max_position_embeddings: int | None = None,
) -> tuple[torch.Tensor, float]:
    """:func:`yarn_inv_freq` from a transformers ``rope_parameters`` dict (``rope_type: yarn``).

    Defaults follow transformers 5.24: ``rope_theta`` falls back to ``theta``,
    ``original_max_position_embeddings`` to ``max_position_embeddings``, a null
    ``factor`` to their ratio, ``truncate`` to true.

    Raises:
        ValueError: For a missing base or context length, or ``partial_rotary_factor`` other than 1.
    """
    p = rope_parameters
    partial = p.get("partial_rotary_factor", 1.0)
    if partial is not None and as_float(partial) != 1.0:
        raise ValueError(f"rope_parameters.partial_rotary_factor: not supported yet: {partial} (only 1.0)")
    base = p.get("rope_theta", theta)
    if base is None:
        raise ValueError("rope_parameters.rope_theta: missing (the RoPE base wavelength)")
    original = p.get("original_max_position_embeddings", max_position_embeddings)
    if original is None:
        raise ValueError("rope_parameters.original_max_position_embeddings: required for rope_type yarn")
    factor = p.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ValueError("rope_parameters.factor: required for rope_type yarn")
        factor = max_position_embeddings / as_float(original)
    return yarn_inv_freq(
        head_dim,
        as_float(base),
        factor=as_float(factor),
        original_max_position_embeddings=as_int(original),
        beta_fast=as_float(p.get("beta_fast") or 32.0),
        beta_slow=as_float(p.get("beta_slow") or 1.0),
        truncate=bool(p.get("truncate", True)),
        attention_factor=_optional_float(p.get("attention_factor")),
        mscale=_optional_float(p.get("mscale")),
        mscale_all_dim=_optional_float(p.get("mscale_all_dim")),
    )


class YarnRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` with YaRN frequencies and cos/sin multiplied by the attention factor.

    Args:
        head_dim: Attention head size (even).
        rope_parameters: transformers' dict with ``rope_type: yarn`` and its keys.
        theta: Base used when the dict has no ``rope_theta``.
        max_position_embeddings: The model's context (default for missing yarn keys).
    """

    def __init__(
        self,
        head_dim: int,
        rope_parameters: Mapping[str, object],
        *,
        theta: float | None = None,
        max_position_embeddings: int | None = None,
    ) -> None:
        base = rope_parameters.get("rope_theta", theta)
        super().__init__(head_dim, _optional_float(base))
        self.rope_type = "yarn"
        self._inv_freq, self.attention_scaling = yarn_from_parameters(
            head_dim, rope_parameters, theta=theta, max_position_embeddings=max_position_embeddings
        )

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # transformers scales in float32 before the cast; same order here.
        inv_freq = self._inv_freq.to(positions.device)
        freqs = positions[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.attention_scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


__all__ = ["YARN_KEYS", "YarnRotaryEmbedding", "yarn_from_parameters", "yarn_inv_freq"]
