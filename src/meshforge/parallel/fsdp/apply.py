"""The two FSDP entry points: ``apply_fsdp`` (one unit per decoder layer, experts on their own mesh) and ``apply_fsdp_patterns`` (units named by module patterns)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypedDict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from meshforge.parallel.fsdp.ignored import all_ignored, mark_ignored
from meshforge.parallel.fsdp.placement import PlacementFn, log_fallbacks, resolve_shard_placement, shard_size

ReshardPolicy = Literal["always", "never", "default"]


class _ShardExtra(TypedDict, total=False):
    """The `fully_shard` arguments given only when set: CPU offload and the ignored parameters."""

    offload_policy: OffloadPolicy
    ignored_params: set[nn.Parameter]


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
    ignored_modules: Sequence[str] | None = None,
    shard_placement: str | None = None,
    expert_placement: str = "shard_by_dim_1",
    hook_modules: Sequence[str] | None = None,
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
        ignored_modules: `parallelism.ignored_modules` patterns; their parameters stay plain,
            replicated tensors (see the module docstring; the trainer must call
            `sync_ignored_grads`). A decoder layer whose parameters are all ignored is not wrapped.
        shard_placement: `parallelism.shard_placement_fn` for every dense unit (layers and root);
            None keeps FSDP's dim 0.
        expert_placement: `parallelism.efsdp_shard_placement_fn` for the experts units.
        hook_modules: `parallelism.hook_modules` patterns: the units, in forward order, that
            prefetch each other (None = every decoder layer).

    Raises:
        ValueError: naming `parallelism.ignored_modules[i]` or `parallelism.shard_placement_fn`.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    extra: _ShardExtra = {"offload_policy": CPUOffloadPolicy()} if cpu_offload else {}
    ignored = mark_ignored(model, ignored_modules, param_dtype=param_dtype)
    if ignored:
        extra["ignored_params"] = ignored
    if reshard_policy == "default":
        reshard = not pipeline_parallel
    else:
        reshard = reshard_policy == "always"
    dense = resolve_shard_placement(shard_placement, shard_size=shard_size(mesh))
    layers = decoder_layers(model)
    experts = _expert_units(model, expert_mesh)
    _refuse_ignored_experts(experts, ignored)
    for index, layer in enumerate(layers):
        # The last layer's parameters are needed again right at the start of backward.
        layer_reshard = reshard and index < len(layers) - 1
        for module in experts.get(id(layer), []):
            if all_ignored(module, ignored):
                continue
            fully_shard(
                module,
                mesh=expert_mesh,
                mp_policy=mp,
                reshard_after_forward=layer_reshard,
                shard_placement_fn=_expert_placement_fn(expert_mesh, expert_placement),
                **extra,
            )
        if all_ignored(layer, ignored):
            continue
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=mp,
            reshard_after_forward=layer_reshard,
            shard_placement_fn=dense,
            **extra,
        )
    fully_shard(
        model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, shard_placement_fn=dense, **extra
    )
    _sum_gradients(model)
    _set_prefetch(
        _prefetch_chain(model, hook_modules, layers, pipeline_parallel),
        forward_prefetch,
        backward_prefetch,
        hook_modules is not None,
    )
    log_fallbacks(dense)
    return model


def _sum_gradients(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Factor 1 + plain SUM: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _check_patterns_over_stages(model: nn.Module, patterns: Sequence[str], key_path: str) -> None:
    """Under pipeline parallelism each rank holds some stages: a pattern must match on some rank.

    Collective over the default group (every rank wraps its stages with FSDP).

    Raises:
        ValueError: `<key_path>[i]` for a pattern that matches no module on any rank.
    """
    from meshforge.utils.patterns import match_modules

    hits = torch.tensor(
        [float(bool(match_modules(model, [p], key_path=key_path, allow_unmatched=True))) for p in patterns]
    )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(hits, op=dist.ReduceOp.MAX)
    for i, hit in enumerate(hits.tolist()):
        if not hit:
            # Raise the usual message, with this rank's module names as examples.
            match_modules(model, [patterns[i]], key_path=f"{key_path}[{i}] (on every pipeline stage)")


def _prefetch_chain(
    model: nn.Module,
    hook_modules: Sequence[str] | None,
    default: list[nn.Module],
    pipeline_parallel: bool = False,
) -> list[nn.Module]:
    """The FSDP units that prefetch each other, in forward order (`parallelism.hook_modules`).

    Raises:
        ValueError: naming `parallelism.hook_modules[i]` for a pattern that matches nothing or a
            module that is not an FSDP unit.
    """
    if hook_modules is None:
        return default
    from meshforge.utils.patterns import match_modules

    key = "parallelism.hook_modules"
    if pipeline_parallel:
        _check_patterns_over_stages(model, list(hook_modules), key)
    chain: list[nn.Module] = []
    module: nn.Module
    for name, module in match_modules(
        model, list(hook_modules), key_path=key, allow_unmatched=pipeline_parallel
    ):
        if not isinstance(module, FSDPModule):
            raise ValueError(
                f"parallelism.hook_modules: {name} is not an FSDP unit, so it cannot prefetch; list modules "
                "that parallelism.fsdp_modules wraps (default: model.layers.{*})"
            )
        chain.append(module)
    return chain


def _set_prefetch(layers: list[nn.Module], forward: int, backward: int, explicit: bool = False) -> None:
    """Explicit all-gather prefetch lists (MindSpeed num_to_forward/backward_prefetch).

    Depth 1 is FSDP2's own implicit schedule over the units in execution order; other depths,
    or an explicit chain (`explicit`, from `hook_modules`), set the lists on each unit.
    """
    for key, depth in (
        ("parallelism.num_to_forward_prefetch", forward),
        ("parallelism.num_to_backward_prefetch", backward),
    ):
        if depth < 0:
            raise ValueError(f"{key}: must be >= 0, got {depth}")
    units: list[FSDPModule] = [layer for layer in layers if isinstance(layer, FSDPModule)]
    for index, layer in enumerate(units):
        if forward != 1 or explicit:
            layer.set_modules_to_forward_prefetch(units[index + 1 : index + 1 + forward])
        if backward != 1 or explicit:
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


def _refuse_ignored_experts(experts: dict[int, list[nn.Module]], ignored: set[nn.Parameter]) -> None:
    """EP-sharded experts cannot be ignored: their gradients differ per ep rank by design.

    `sync_ignored_grads` sums over the loss group, which contains the ep ranks; summing the
    gradients of different experts would be wrong, so such a configuration is refused.
    """
    ids = {id(p) for p in ignored}
    for modules in experts.values():
        for module in modules:
            if any(id(p) in ids for p in module.parameters()):
                raise ValueError(
                    "parallelism.ignored_modules: matches experts sharded by expert parallelism "
                    f"({type(module).__name__}); they get their own FSDP units on the expert mesh and "
                    "cannot be left out: remove the pattern or set expert_parallel to 1"
                )


def _expert_placement_fn(expert_mesh: DeviceMesh | None, name: str = "shard_by_dim_1") -> PlacementFn | None:
    """`shard_placement_fn` for EP-sharded expert weights (`parallelism.efsdp_shard_placement_fn`).

    The default `shard_by_dim_1` shards dim 1 where it divides, since dim 0 is already the ep
    dimension; FSDP2 refuses uneven sharding on a dim other than 0, so a dim 1 that does not
    divide falls back to dim 0 (the ep dim, which FSDP2 strides).
    """
    assert expert_mesh is not None
    return resolve_shard_placement(
        name, shard_size=shard_size(expert_mesh), key_path="parallelism.efsdp_shard_placement_fn"
    )


def apply_fsdp_patterns(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    fsdp_modules: list[str],
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype,
    reshard_policy: ReshardPolicy = "default",
    key_path: str = "parallelism.fsdp_modules",
    ignored_modules: Sequence[str] | None = None,
    shard_placement: str | None = None,
    pipeline_parallel: bool = False,
    cpu_offload: bool = False,
    forward_prefetch: int = 1,
    backward_prefetch: int = 1,
    hook_modules: Sequence[str] | None = None,
) -> nn.Module:
    """Shard `model` in place by module patterns (MindSpeed `fsdp_modules`), then the root.

    Each module whose name matches a pattern (`model.layers.{*}`; `{}` means `{*}`) becomes an
    FSDP unit; nested matches are wrapped innermost first, as FSDP2 needs. A module holding a
    tied parameter (tied input/output embeddings) is not wrapped on its own: a parameter can
    belong to one FSDP unit only, so the root keeps it. A module whose parameters are all
    ignored (`ignored_modules`) is not wrapped either.

    As in MindSpeed, `shard_placement` (`parallelism.shard_placement_fn`) applies to the units
    of the first pattern only; the other units and the root shard on dim 0. `reshard_policy`,
    `cpu_offload` and the prefetch depths mean what they mean for `apply_fsdp`; the prefetch
    chain is the units matching `hook_modules` (None: every unit, in forward order).

    Raises:
        ValueError: `<key_path>[i]: ...` for a pattern that is invalid or matches no module;
            `parallelism.ignored_modules[i]` / `parallelism.shard_placement_fn` likewise.
    """
    from meshforge.utils.patterns import match_modules

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if reshard_policy == "default":
        reshard = not pipeline_parallel
    else:
        reshard = reshard_policy == "always"
    ignored = mark_ignored(model, ignored_modules, param_dtype=param_dtype)
    extra: _ShardExtra = {"ignored_params": ignored} if ignored else {}
    if cpu_offload:
        extra["offload_policy"] = CPUOffloadPolicy()
    tied = _tied_parameter_ids(model)
    if pipeline_parallel:
        _check_patterns_over_stages(model, fsdp_modules, key_path)
    units = [
        module
        for _, module in match_modules(
            model, fsdp_modules, key_path=key_path, allow_unmatched=pipeline_parallel
        )
        if module is not model
        and not any(id(p) in tied for p in module.parameters())
        and not all_ignored(module, ignored)
    ]
    first = {
        id(m)
        for _, m in match_modules(
            model, fsdp_modules[:1], key_path=key_path, allow_unmatched=pipeline_parallel
        )
    }
    # After the patterns are checked: their errors come first (and need no mesh).
    placement = resolve_shard_placement(shard_placement, shard_size=shard_size(mesh))
    # named_modules() lists parents before children: wrap in reverse so children come first.
    for module in reversed(units):
        # The last unit in forward order is needed again right at the start of backward.
        last = module is units[-1]
        fully_shard(
            module,
            mesh=mesh,
            mp_policy=mp,
            reshard_after_forward=reshard and not last,
            shard_placement_fn=placement if id(module) in first else None,
            **extra,
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, **extra)
    _sum_gradients(model)
    _set_prefetch(
        _prefetch_chain(model, hook_modules, units, pipeline_parallel),
        forward_prefetch,
        backward_prefetch,
        hook_modules is not None,
    )
    log_fallbacks(placement)
    return model


def _tied_parameter_ids(model: nn.Module) -> set[int]:
    """Ids of parameters that appear under more than one name (tied weights)."""
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {pid for pid, count in seen.items() if count > 1}
