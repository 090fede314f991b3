"""Rotary position embedding ("default" RoPE of transformers) computed from position ids.

cos/sin are derived from ``position_ids`` rather than from the sequence index, so
packed rows (positions restarting per document) and arbitrary offsets work. The
module holds no parameters or buffers: a model built on the meta device and
materialised with ``to_empty`` needs no extra re-initialisation step, and
checkpoints carry nothing derived. For the common case (no ``position_ids``) the
cos/sin table for ``0..S-1`` is cached per device and dtype and sliced, instead of
being recomputed on every forward.
"""

from __future__ import annotations

import torch
from torch import nn


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies ``1 / theta^(2i/d)`` in float32, as transformers computes them.

    Args:
        head_dim: Rotated dimension (the attention head size); must be even.
        theta: RoPE base wavelength (``rope_theta``).

    Returns:
        A float32 CPU tensor of shape ``[head_dim // 2]``.
    """
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))


class RotaryEmbedding(nn.Module):
    """Produces ``(cos, sin)`` of shape ``[B or 1, S, head_dim]`` for given positions.

    Args:
        head_dim: Attention head size (even).
        theta: RoPE base wavelength.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.theta = float(theta)
        self._inv_freq = default_inv_freq(head_dim, self.theta)
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
