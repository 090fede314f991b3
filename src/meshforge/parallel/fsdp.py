"""FSDP2 (`fully_shard`) for meshforge models: one unit per decoder layer, then the root.

The trainer normalises the loss by the global valid-token count itself, so FSDP's own gradient
division is turned off (divide factor 1): the reduce-scatter must *sum* the per-rank gradients.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

ReshardPolicy = Literal["always", "never", "default"]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a HF-style causal LM (`model.layers`)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no `model.layers`; cannot place FSDP units")
    return list(layers)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype,
    reshard_policy: ReshardPolicy = "default",
    pipeline_parallel: bool = False,
) -> nn.Module:
    """Shard `model` in place: each decoder layer is an FSDP unit, the root holds the rest.

    Args:
        mesh: 1-D (FSDP) or 2-D (HSDP: replicate x shard) mesh.
        param_dtype: compute dtype of the unsharded parameters (None = keep the stored dtype).
        reduce_dtype: dtype of the gradient reduce-scatter.
        reshard_policy: `always` frees the unsharded parameters after forward (less memory, one
            more all-gather in backward), `never` keeps them, `default` = always unless pipeline
            parallel (where the same stage runs several micro-batches back to back).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if reshard_policy == "default":
        reshard = not pipeline_parallel
    else:
        reshard = reshard_policy == "always"
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        # The last layer's parameters are needed again right at the start of backward.
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard and index < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Factor 1 + plain SUM: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model
