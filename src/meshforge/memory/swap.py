"""Activation swap: saved tensors of selected layers/modules go to host memory until backward."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from meshforge.memory.config import SwapConfig


def apply_swap(
    model: nn.Module, cfg: SwapConfig, *, num_layers: int
) -> tuple[dict[int, list[str]], Callable[[], int]]:
    """Offload the saved tensors ``cfg`` selects; ``(layer -> paths, bytes moved since last call)``."""
    raise NotImplementedError("not supported yet: swap")
