"""LoRA adapters in the layout plan: which parameters train, and how each rank holds them.

A LoRA run (`lora_config` set) freezes the whole base model: its parameters take no gradient
and no optimizer state, and when ``model.compute_dtype`` differs from ``model.params_dtype``
`apply_lora` stores them in the compute dtype (a weight that never updates needs no master
copy). Only the adapters train: a targeted ``nn.Linear`` of ``in -> out`` features gets
``A [r, in]`` and ``B [out, r]``, ``r * (in + out)`` parameters in ``params_dtype``, with
gradients and AdamW state of their own. So a rank's weights are its shard of the base plus its
adapters, while gradients and optimizer state cover the adapters alone.

Placement follows the trainer (`lora.layer.adapter_placements`): under tensor parallelism a
column-wise base splits B over the TP ranks and keeps A whole on each of them, a row-wise base
splits A and keeps B whole, and a linear the family's TP plan leaves whole keeps both whole.
FSDP shards the adapters over the dense shard group, in their decoder layer's unit; an adapter
sits on the pipeline stage of its layer (the head's and any other outside the layers on the
last stage, as their bases).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from meshforge.config.root import TrainConfig
    from meshforge.models.spec import FamilySpec

_LAYER_MARKER = ".layers."


@dataclass(frozen=True)
class AdapterCounts:
    """Adapter parameters of a LoRA run, each as ``(split by TP, held whole by every TP rank)``.

    Attributes:
        layers: Global decoder-layer index -> its adapters (MTP blocks keep their model index).
        head: Adapters on ``lm_head`` (last pipeline stage).
        other: Adapters on any other linear outside the decoder layers (last pipeline stage).
        targets: How many linears carry adapters.
        rank: The adapters' inner size r.
    """

    layers: dict[int, tuple[int, int]] = field(default_factory=dict)
    head: tuple[int, int] = (0, 0)
    other: tuple[int, int] = (0, 0)
    targets: int = 0
    rank: int = 0

    @property
    def total(self) -> int:
        """Every adapter parameter of the model (before any sharding)."""
        parts = [*self.layers.values(), self.head, self.other]
        return sum(split + whole for split, whole in parts)


def _tp_styles(cfg: TrainConfig, spec: FamilySpec, model: nn.Module) -> dict[str, str]:
    """``module path -> 'colwise' | 'rowwise'`` for the linears the family's TP plan splits."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    tp = int(cfg.parallelism.tensor_parallel)
    if tp == 1 or spec.tp_plan is None:
        # A family planned by the tp_colwise/tp_rowwise patterns: its adapters are counted whole,
        # an upper bound on what each TP rank holds.
        return {}
    plan = spec.tp_plan(
        model, tp=tp, sequence_parallel=True, loss_parallel=cfg.parallelism.enable_loss_parallel
    )
    styles: dict[str, str] = {}
    for path, style in plan.items():
        if isinstance(style, ColwiseParallel):
            styles[path] = "colwise"
        elif isinstance(style, RowwiseParallel):
            styles[path] = "rowwise"
    return styles


def count_adapters(cfg: TrainConfig, spec: FamilySpec, model: nn.Module) -> AdapterCounts:
    """The adapters `apply_lora` would attach to ``model`` (built on the meta device), by placement.

    The targets are chosen by the trainer's own selection (`lora.apply.select_targets`), so the
    plan refuses a pattern that matches no linear as ``train`` does.
    """
    from meshforge.lora.apply import select_targets
    from meshforge.lora.settings import lora_settings

    section = cfg.lora_config
    assert section is not None
    settings = lora_settings(section)
    targets = select_targets(model, settings.target_modules, settings.exclude_layers)
    styles = _tp_styles(cfg, spec, model)
    r = settings.rank
    layers: dict[int, tuple[int, int]] = {}
    head = other = (0, 0)
    for path, linear in targets:
        a, b = r * linear.in_features, r * linear.out_features
        style = styles.get(path)
        part = (b, a) if style == "colwise" else (a, b) if style == "rowwise" else (0, a + b)
        dotted = f".{path}."
        if _LAYER_MARKER in dotted:
            index = int(dotted.split(_LAYER_MARKER, 1)[1].split(".", 1)[0])
            split, whole = layers.get(index, (0, 0))
            layers[index] = (split + part[0], whole + part[1])
        elif path.startswith("lm_head"):
            head = (head[0] + part[0], head[1] + part[1])
        else:
            other = (other[0] + part[0], other[1] + part[1])
    return AdapterCounts(layers=layers, head=head, other=other, targets=len(targets), rank=r)


__all__ = ["AdapterCounts", "count_adapters"]
