"""Apply the activation-memory sections to a model: recompute, communication recompute, swap.

One entry point for ``parallel.parallelize_model``, which runs it after CP and before chunked
micro-batches, compile and FSDP (the order DESIGN.md fixes): the layers are already split
for the pipeline stage and sharded for TP/EP/CP, so what is recomputed or offloaded is what
this rank really computes, and FSDP's hooks stay outside the wrapped forwards.

Each feature changes the modules it selects in place (their calls or forwards are wrapped; the
module tree and the parameter names do not change, so checkpoints, module patterns and the
TP/FSDP plans are untouched).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshforge.memory.config import RecomputeCommConfig, RecomputeConfig, SwapConfig


@dataclass(frozen=True)
class ActivationSettings:
    """The three config sections, as ``parallelize_model`` receives them."""

    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    recompute_comm: RecomputeCommConfig = field(default_factory=RecomputeCommConfig)
    swap: SwapConfig = field(default_factory=SwapConfig)

    @property
    def active(self) -> bool:
        """Whether any of the three changes the model."""
        return self.recompute.mode != "None" or self.recompute_comm.enable or self.swap.enable


@dataclass
class ActivationMemory:
    """What was applied, for the log line and the per-step metrics.

    Attributes:
        recomputed: ``layer index -> module paths`` recomputed in backward ("" = the whole layer).
        comm_recomputed: ``layer index -> module paths`` whose gathered input is gathered again.
        swapped: ``layer index -> module paths`` whose saved tensors go to host memory.
        swap_bytes: Returns the bytes moved to host memory since the last call (0 without swap).
    """

    recomputed: dict[int, list[str]] = field(default_factory=dict)
    comm_recomputed: dict[int, list[str]] = field(default_factory=dict)
    swapped: dict[int, list[str]] = field(default_factory=dict)
    swap_bytes: Callable[[], int] = field(default=lambda: 0)

    def summary(self) -> str:
        """One log line: which layers got what."""
        parts = []
        for name, table in (
            ("recompute", self.recomputed),
            ("recompute_comm", self.comm_recomputed),
            ("swap", self.swapped),
        ):
            if table:
                parts.append(f"{name} {_describe(table)}")
        return "activation memory: " + ("; ".join(parts) if parts else "nothing applied")


def _describe(table: dict[int, list[str]]) -> str:
    groups: dict[str, list[int]] = {}
    for index in sorted(table):
        groups.setdefault(", ".join(table[index]) or "whole layer", []).append(index)
    return "; ".join(f"{what} in layers {_ranges(idx)}" for what, idx in groups.items())


def _ranges(indices: list[int]) -> str:
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def apply_activation_memory(
    model: nn.Module,
    settings: ActivationSettings,
    *,
    num_layers: int,
    tp_mesh: DeviceMesh | None,
    sequence_parallel: bool = False,
) -> ActivationMemory:
    """Wrap the selected modules of ``model`` (this rank's layers) in place.

    Args:
        num_layers: Decoder layers of the whole model (layer specs are checked against it; a
            pipeline stage holds only some of them).
        tp_mesh: The TP mesh when tensor parallelism was applied (communication recompute
            needs it), else None.
        sequence_parallel: Whether TP splits the hidden states along the sequence (the caller,
            which applied TP, knows; without it communication recompute has nothing to gather).

    Raises:
        ValueError: A layer spec or module key names nothing (the message names the key).
    """
    from meshforge.memory.comm import apply_comm_recompute
    from meshforge.memory.recompute import apply_recompute
    from meshforge.memory.swap import apply_swap

    applied = ActivationMemory()
    if settings.recompute_comm.enable:
        applied.comm_recomputed = apply_comm_recompute(
            model,
            settings.recompute_comm,
            num_layers=num_layers,
            tp_mesh=tp_mesh,
            sequence_parallel=sequence_parallel,
        )
    if settings.swap.enable:
        applied.swapped, applied.swap_bytes = apply_swap(model, settings.swap, num_layers=num_layers)
    if settings.recompute.mode != "None":
        applied.recomputed = apply_recompute(model, settings.recompute, num_layers=num_layers)
    return applied
