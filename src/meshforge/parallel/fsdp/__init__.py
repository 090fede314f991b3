"""FSDP2 (`fully_shard`) for meshforge models: one unit per decoder layer, then the root.

Modules: `apply.py` (the entry points `apply_fsdp` and `apply_fsdp_patterns`, prefetch chains,
expert units), `ignored.py` (ignored modules and their gradient sum), `placement.py` (shard
placement rules).

The trainer normalises the loss by the global valid-token count itself, so FSDP's own gradient
division is turned off (divide factor 1): the reduce-scatter must *sum* the per-rank gradients.

Expert-FSDP: under expert parallelism the experts' weights are DTensors sharded over the `ep`
mesh (`meshforge.parallel.expert.apply_ep`); each experts module then becomes its own FSDP unit
on the `efsdp` mesh (the data ranks that hold the same experts), wrapped before its decoder
layer so that the layer's unit on the dense mesh leaves it alone. FSDP2 combines the two into
one DTensor on (efsdp, ep); it shards expert weights on dim 1 (MindSpeed's `shard_by_dim_1`),
since dim 0 is already the ep dimension, and on dim 0 only when dim 1 does not divide.

Ignored modules (`parallelism.ignored_modules`, MindSpeed's `ignored_modules`): FSDP leaves
their parameters alone (`ignored_params=` on every `fully_shard` call). They stay plain tensors,
whole and replicated on every data rank, so their gradients are *not* reduced by FSDP: after the
backward of all micro-batches the trainer calls `sync_ignored_grads` (one bucketed all-reduce
over the loss mesh). The ignored parameter names are recorded on the model
(`ignored_parameter_names`). The optimizer and clipping handle models that mix DTensor and plain
parameters (`meshforge.optim.param_groups.split_by_tensor_kind`, `meshforge.optim.clip`).

Shard placement (`parallelism.shard_placement_fn`, `efsdp_shard_placement_fn`): which dim of each
parameter FSDP shards. Built-ins `shard_by_dim_0`, `shard_by_dim_1`, `shard_largest_dim`, or a
user function `package.module:function` (see `resolve_shard_placement`).
"""

from meshforge.parallel.fsdp.apply import (
    _expert_placement_fn,
    apply_fsdp,
    apply_fsdp_patterns,
    decoder_layers,
)
from meshforge.parallel.fsdp.ignored import (
    IGNORED_ATTR,
    ignored_parameter_names,
    ignored_parameters,
    mark_ignored,
    sync_ignored_grads,
)
from meshforge.parallel.fsdp.placement import SHARD_PLACEMENTS, PlacementFn, resolve_shard_placement

__all__ = [
    "IGNORED_ATTR",
    "SHARD_PLACEMENTS",
    "PlacementFn",
    "_expert_placement_fn",
    "apply_fsdp",
    "apply_fsdp_patterns",
    "decoder_layers",
    "ignored_parameter_names",
    "ignored_parameters",
    "mark_ignored",
    "resolve_shard_placement",
    "sync_ignored_grads",
]
