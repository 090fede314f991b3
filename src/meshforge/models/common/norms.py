"""RMSNorm with the Hugging Face parameter layout (``weight`` only, ones at init).

The computation goes through ``torch.nn.functional.rms_norm``, which dispatches to a
fused kernel (one pass forward, one backward) and matches the transformers
reference (``x * rsqrt(mean(x^2) + eps) * weight`` in float32) to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension.

    Args:
        dim: Size of the normalised (last) dimension.
        eps: Added to the mean square before the reciprocal square root.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._shape = (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            # Like transformers: normalise in float32, scale after casting back, so
            # low-precision runs round at the same places as the reference.
            normed = F.rms_norm(x.float(), self._shape, None, self.eps).to(x.dtype)
            return self.weight * normed
        return F.rms_norm(x, self._shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self._shape[0]}, eps={self.eps}"
