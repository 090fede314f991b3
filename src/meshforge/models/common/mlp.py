"""Gated MLP (SwiGLU): ``down_proj(act(gate_proj(x)) * up_proj(x))``, transformers' names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu}


def activation(name: str):
    """Return the activation function for a transformers ``hidden_act`` name.

    Raises:
        ValueError: For a name that is not built (listing the ones that are).
    """
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"hidden_act {name!r} is not supported; use one of {sorted(_ACTIVATIONS)}") from None


class GatedMLP(nn.Module):
    """SwiGLU feed-forward block.

    Args:
        hidden_size: Model width.
        intermediate_size: Width of the gated hidden layer.
        hidden_act: Activation name (``silu`` for SwiGLU).
        bias: Bias on the three projections.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", *, bias: bool = False
    ):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
