"""FSDP2 (`fully_shard`) for meshforge models: one unit per decoder layer, then the root.

The trainer normalises the loss by the global valid-token count itself, so FSDP's own gradient
division is turned off (divide factor 1): the reduce-scatter must *sum* the per-rank gradients.

Expert-FSDP: under expert parallelism the experts' weights are DTensors sharded over the `ep`
mesh (`meshforge.parallel.expert.apply_ep`); each experts module then becomes its own FSDP unit
on the `efsdp` mesh (the data ranks that hold the same experts), wrapped before its decoder
layer so that the layer's unit on the dense mesh leaves it alone. FSDP2 combines the two into
one DTensor on (efsdp, ep); it shards expert weights on dim 1 (MindSpeed's `shard_by_dim_1`),
since dim 0 is already the ep dimension, and on dim 0 only when dim 1 does not divide.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

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
    expert_mesh: DeviceMesh | None = None,
    cpu_offload: bool = False,
    forward_prefetch: int = 1,
    backward_prefetch: int = 1,
) -> nn.Module:
    """Shard `model` in place: each decoder layer is an FSDP unit, the root holds the rest.

    Args:
        mesh: 1-D (FSDP) or 2-D (HSDP: replicate x shard) mesh.
        expert_mesh: the `efsdp` mesh (1-D, or 2-D replicate x shard under HSDP) when the
            experts are sharded over EP: each experts module becomes an FSDP unit on it. Size 1
            is fine (EP over all data ranks). Required exactly when EP was applied.
        param_dtype: compute dtype of the unsharded parameters (None = keep the stored dtype).
        reduce_dtype: dtype of the gradient reduce-scatter.
        reshard_policy: `always` frees the unsharded parameters after forward (less memory, one
            more all-gather in backward), `never` keeps them, `default` = always unless pipeline
            parallel (where the same stage runs several micro-batches back to back).
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory
            (`CPUOffloadPolicy`; the optimizer step then runs on the CPU).
        forward_prefetch, backward_prefetch: how many following (forward) / preceding
            (backward) decoder layers each layer's all-gather is issued ahead for. 1 is FSDP2's
            own implicit schedule; other values set the lists explicitly.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    extra: dict[str, Any] = {"offload_policy": CPUOffloadPolicy()} if cpu_offload else {}
    if reshard_policy == "default":
        reshard = not pipeline_parallel
    else:
        reshard = reshard_policy == "always"
    layers = decoder_layers(model)
    experts = _expert_units(model, expert_mesh)
    for index, layer in enumerate(layers):
        # The last layer's parameters are needed again right at the start of backward.
        layer_reshard = reshard and index < len(layers) - 1
        for module in experts.get(id(layer), []):
            placement = _expert_placement_fn(expert_mesh)
            fully_shard(
                module,
                mesh=expert_mesh,
                mp_policy=mp,
                reshard_after_forward=layer_reshard,
                shard_placement_fn=placement,
                **extra,
            )
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=layer_reshard, **extra)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, **extra)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Factor 1 + plain SUM: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    _set_prefetch(layers, forward_prefetch, backward_prefetch)
    return model


def _set_prefetch(layers: list[nn.Module], forward: int, backward: int) -> None:
    """Explicit all-gather prefetch lists (MindSpeed num_to_forward/backward_prefetch)."""
    for key, depth in (
        ("parallelism.num_to_forward_prefetch", forward),
        ("parallelism.num_to_backward_prefetch", backward),
    ):
        if depth < 0:
            raise ValueError(f"{key}: must be >= 0, got {depth}")
    units = [layer for layer in layers if isinstance(layer, FSDPModule)]
    for index, layer in enumerate(units):
        if forward != 1:
            layer.set_modules_to_forward_prefetch(units[index + 1 : index + 1 + forward])
        if backward != 1:
            layer.set_modules_to_backward_prefetch(list(reversed(units[max(0, index - backward) : index])))


def _expert_units(model: nn.Module, expert_mesh: DeviceMesh | None) -> dict[int, list[nn.Module]]:
    """EP-sharded experts modules by the id of the decoder layer that holds them.

    Raises:
        ValueError: experts are EP-sharded but no `expert_mesh` was given, or the other way round.
    """
    from meshforge.parallel.expert import is_expert_parallel

    layers = decoder_layers(model)
    units: dict[int, list[nn.Module]] = {}
    found = 0
    for layer in layers:
        modules = [m for m in layer.modules() if is_expert_parallel(m)]
        found += len(modules)
        if modules:
            units[id(layer)] = modules
    if found and expert_mesh is None:
        raise ValueError(
            "apply_fsdp: the experts are sharded over expert parallelism; pass expert_mesh (the efsdp mesh)"
        )
    if expert_mesh is not None and not found:
        raise ValueError("apply_fsdp: expert_mesh given but no experts were sharded by apply_ep")
    return units


def _expert_placement_fn(expert_mesh: DeviceMesh | None):
    """`shard_placement_fn` for EP-sharded expert weights: dim 1 (`shard_by_dim_1`) when it divides."""
    assert expert_mesh is not None
    # The shard axis is the last one of a 2-D (replicate, shard) mesh.
    shards = expert_mesh.size(expert_mesh.ndim - 1)

    def placement(param: nn.Parameter) -> Shard:
        # FSDP2 refuses uneven sharding on a dim other than 0; dim 0 (the ep dim) it can stride.
        return Shard(1) if param.ndim > 1 and param.shape[1] % shards == 0 else Shard(0)

    return placement


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
