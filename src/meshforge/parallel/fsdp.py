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
    # A pipeline stage keeps its layers in a ModuleDict keyed by their global index.
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


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


def apply_fsdp_patterns(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    fsdp_modules: list[str],
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype,
    reshard_policy: ReshardPolicy = "default",
    key_path: str = "parallelism.fsdp_modules",
) -> nn.Module:
    """Shard `model` in place by module patterns (MindSpeed `fsdp_modules`), then the root.

    Each module whose name matches a pattern (`model.layers.{*}`; `{}` means `{*}`) becomes an
    FSDP unit; nested matches are wrapped innermost first, as FSDP2 needs. A module holding a
    tied parameter (tied input/output embeddings) is not wrapped on its own: a parameter can
    belong to one FSDP unit only, so the root keeps it.

    Raises:
        ValueError: `<key_path>[i]: ...` for a pattern that is invalid or matches no module.
    """
    from meshforge.parallel.patterns import match_modules

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshard = reshard_policy != "never"
    tied = _tied_parameter_ids(model)
    units = [
        module
        for _, module in match_modules(model, fsdp_modules, key_path=key_path)
        if module is not model and not any(id(p) in tied for p in module.parameters())
    ]
    # named_modules() lists parents before children: wrap in reverse so children come first.
    for module in reversed(units):
        # The last unit in forward order is needed again right at the start of backward.
        last = module is units[-1]
        fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard and not last)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def _tied_parameter_ids(model: nn.Module) -> set[int]:
    """Ids of parameters that appear under more than one name (tied weights)."""
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {pid for pid, count in seen.items() if count > 1}
