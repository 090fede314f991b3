"""Communication recompute: gathered TP/SP inputs are gathered again in backward, not saved."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshforge.memory.config import RecomputeCommConfig


def apply_comm_recompute(
    model: nn.Module, cfg: RecomputeCommConfig, *, num_layers: int, tp_mesh: DeviceMesh | None
) -> dict[int, list[str]]:
    """Re-gather instead of saving the inputs of the modules ``cfg`` selects; ``layer -> paths``."""
    raise NotImplementedError("not supported yet: recompute_comm")
