"""RMSNorm with the Hugging Face parameter layout (``weight`` only, ones at init).

By default the computation goes through ``torch.nn.functional.rms_norm``, which
dispatches to a fused kernel (one pass forward, one backward) and matches the
transformers reference (``x * rsqrt(mean(x^2) + eps) * weight`` in float32) to
rounding. ``fused = False`` (the ``kernels.use_fused_rmsnorm: false`` switch) runs the
reference formulation op by op, exactly as transformers writes it.
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
        # Set by the `use_fused_rmsnorm` kernel switch (meshforge.models.common.kernels).
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return self._reference(x)
        if x.dtype != torch.float32:
            # Like transformers: normalise in float32, scale after casting back, so
            # low-precision runs round at the same places as the reference.
            normed = F.rms_norm(x.float(), self._shape, None, self.eps).to(x.dtype)
            return self.weight * normed
        return F.rms_norm(x, self._shape, self.weight, self.eps)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' ``Qwen3RMSNorm.forward``: float32 statistics, scale in the input dtype."""
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self._shape[0]}, eps={self.eps}"
