"""FSDP2 (`fully_shard`) for meshforge models: one unit per decoder layer, then the root.

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

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_map_only

ReshardPolicy = Literal["always", "never", "default"]
PlacementFn = Callable[[nn.Parameter], Shard | None]

log = logging.getLogger(__name__)

# Built-in shard placement names (MindSpeed's two plus one of ours).
SHARD_PLACEMENTS = ("shard_by_dim_0", "shard_by_dim_1", "shard_largest_dim")
# The attribute of the root model that lists the parameters FSDP ignores.
IGNORED_ATTR = "_meshforge_fsdp_ignored"


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
    extra: dict[str, Any] = {"offload_policy": CPUOffloadPolicy()} if cpu_offload else {}
    ignored = mark_ignored(model, ignored_modules, param_dtype=param_dtype)
    if ignored:
        extra["ignored_params"] = ignored
    if reshard_policy == "default":
        reshard = not pipeline_parallel
    else:
        reshard = reshard_policy == "always"
    dense = resolve_shard_placement(shard_placement, shard_size=_shard_size(mesh))
    layers = decoder_layers(model)
    experts = _expert_units(model, expert_mesh)
    _refuse_ignored_experts(experts, ignored)
    for index, layer in enumerate(layers):
        # The last layer's parameters are needed again right at the start of backward.
        layer_reshard = reshard and index < len(layers) - 1
        for module in experts.get(id(layer), []):
            if _all_ignored(module, ignored):
                continue
            fully_shard(
                module,
                mesh=expert_mesh,
                mp_policy=mp,
                reshard_after_forward=layer_reshard,
                shard_placement_fn=_expert_placement_fn(expert_mesh, expert_placement),
                **extra,
            )
        if _all_ignored(layer, ignored):
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
    _log_fallbacks(dense)
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
    from meshforge.parallel.patterns import match_modules

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
    from meshforge.parallel.patterns import match_modules

    key = "parallelism.hook_modules"
    if pipeline_parallel:
        _check_patterns_over_stages(model, list(hook_modules), key)
    chain = []
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
    units = [layer for layer in layers if isinstance(layer, FSDPModule)]
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
        name, shard_size=_shard_size(expert_mesh), key_path="parallelism.efsdp_shard_placement_fn"
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
    from meshforge.parallel.patterns import match_modules

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if reshard_policy == "default":
        reshard = not pipeline_parallel
    else:
        reshard = reshard_policy == "always"
    ignored = mark_ignored(model, ignored_modules, param_dtype=param_dtype)
    extra: dict[str, Any] = {"ignored_params": ignored} if ignored else {}
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
        and not _all_ignored(module, ignored)
    ]
    first = {
        id(m)
        for _, m in match_modules(
            model, fsdp_modules[:1], key_path=key_path, allow_unmatched=pipeline_parallel
        )
    }
    # After the patterns are checked: their errors come first (and need no mesh).
    placement = resolve_shard_placement(shard_placement, shard_size=_shard_size(mesh))
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
    _log_fallbacks(placement)
    return model


def _tied_parameter_ids(model: nn.Module) -> set[int]:
    """Ids of parameters that appear under more than one name (tied weights)."""
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {pid for pid, count in seen.items() if count > 1}


# ----------------------------------------------------------------------------- ignored modules
def mark_ignored(
    model: nn.Module,
    patterns: Sequence[str] | None,
    *,
    param_dtype: torch.dtype | None = None,
    key_path: str = "parallelism.ignored_modules",
) -> set[nn.Parameter]:
    """Resolve `ignored_modules` patterns, record the ignored names on `model`, return the params.

    The names (as `model.named_parameters()` gives them) are stored in the attribute
    `IGNORED_ATTR` of `model`, read back by `ignored_parameter_names`. With `param_dtype` set
    (FSDP mixed precision), each outermost ignored module gets hooks that run it in its
    parameters' stored dtype: its floating inputs are cast to that dtype and its floating
    outputs to `param_dtype`, as FSDP's own units do for theirs.

    Raises:
        ValueError: `<key_path>[i]: ...` for a pattern that is invalid, matches no module, or
            matches only modules without parameters; `<key_path>` when every parameter would
            be ignored (nothing left to shard).
    """
    from meshforge.parallel.patterns import compile_pattern, match_modules

    if not patterns:
        setattr(model, IGNORED_ATTR, ())
        return set()
    if isinstance(patterns, str):
        raise ValueError(f"{key_path}: expected a list of module patterns, got the string {patterns!r}")
    matched = match_modules(model, list(patterns), key_path=key_path)
    for i, pattern in enumerate(patterns):
        compiled = compile_pattern(pattern)
        if not any(compiled.matches(name) and any(True for _ in m.parameters()) for name, m in matched):
            raise ValueError(
                f"{key_path}[{i}]: pattern {pattern!r} matches only modules without parameters; "
                "name the modules whose weights FSDP should leave unsharded"
            )
    params = {id(p): p for _, module in matched for p in module.parameters()}
    names = tuple(name for name, p in model.named_parameters() if id(p) in params)
    if all(id(p) in params for p in model.parameters()):
        raise ValueError(
            f"{key_path}: every parameter of the model is ignored, so FSDP has nothing to shard; "
            "ignore fewer modules or use no data-parallel sharding"
        )
    setattr(model, IGNORED_ATTR, names)
    if param_dtype is not None:
        outer = [
            (name, m) for name, m in matched if not any(name.startswith(f"{other}.") for other, _ in matched)
        ]
        for _, module in outer:
            _add_cast_hooks(module, param_dtype)
    log.info("FSDP ignores %d parameter tensors (kept whole on every rank): %s", len(names), _few(names))
    return set(params.values())


def _add_cast_hooks(module: nn.Module, compute_dtype: torch.dtype) -> None:
    """Run an ignored module in its stored dtype between FSDP units that compute in `compute_dtype`."""
    stored = next(module.parameters()).dtype

    def cast(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: t.to(dtype) if t.is_floating_point() else t

    def before(_module: nn.Module, args: Any, kwargs: Any) -> Any:
        return tree_map_only(torch.Tensor, cast(stored), (args, kwargs))

    def after(_module: nn.Module, _args: Any, output: Any) -> Any:
        return tree_map_only(torch.Tensor, cast(compute_dtype), output)

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after)


def ignored_parameter_names(model: nn.Module) -> tuple[str, ...]:
    """Names of the parameters FSDP was told to ignore (empty when none or not FSDP-wrapped)."""
    return tuple(getattr(model, IGNORED_ATTR, ()))


def ignored_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """`(name, parameter)` of the ignored parameters that are trained (`requires_grad`)."""
    out = [(name, model.get_parameter(name)) for name in ignored_parameter_names(model)]
    return [(name, p) for name, p in out if p.requires_grad]


def _all_ignored(module: nn.Module, ignored: set[nn.Parameter]) -> bool:
    """Whether `module` has parameters and FSDP ignores all of them (then it is not a unit)."""
    ids = {id(p) for p in ignored}
    params = list(module.parameters())
    return bool(params) and all(id(p) in ids for p in params)


@torch.no_grad()
def sync_ignored_grads(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Sum the gradients of FSDP-ignored parameters over `group` (bucketed: one collective per dtype).

    FSDP reduce-scatters the gradients of the parameters it shards, but leaves ignored ones as
    each rank computed them from its own micro-batches. Call this after the backward of every
    micro-batch of a step and before clipping, with the loss group (the data-parallel and
    context-parallel ranks): the trainer divides the loss by the global token count, so the sum
    over ranks is the global gradient, the same on every rank. A parameter with a gradient on
    some ranks only gets zeros added for the others; one with no gradient on any rank keeps None
    (a presence flag travels in the same buffer). DTensor parameters (e.g. under tensor
    parallelism) have their local tensors summed.

    Args:
        model: the model `apply_fsdp`/`apply_fsdp_patterns` marked.
        group: process group to sum over; None = the default group.

    Returns:
        The number of parameters whose gradients were summed (0 when nothing is ignored).
    """
    params = [p for _, p in ignored_parameters(model)]
    if not params:
        return 0
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    buckets: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
    for p in params:
        local = p.to_local() if isinstance(p, DTensor) else p
        buckets.setdefault((local.device, local.dtype), []).append(p)
    synced = 0
    for (device, dtype), bucket in buckets.items():
        pieces: list[torch.Tensor] = []
        flags = torch.zeros(len(bucket), device=device, dtype=dtype)
        for i, p in enumerate(bucket):
            grad = _local(p.grad)
            if grad is None:
                pieces.append(torch.zeros(_local(p).numel(), device=device, dtype=dtype))
            else:
                pieces.append(grad.reshape(-1).to(dtype))
                flags[i] = 1
        flat = torch.cat([*pieces, flags])
        if world > 1:
            dist.all_reduce(flat, group=group)
        # Reading the flags back is a host sync: only needed when this rank lacks a gradient.
        missing = any(p.grad is None for p in bucket)
        present = flat[-len(bucket) :].tolist() if missing else [1.0] * len(bucket)
        offset = 0
        for p, piece, flag in zip(bucket, pieces, present, strict=True):
            summed = flat[offset : offset + piece.numel()]
            offset += piece.numel()
            if flag == 0:
                continue
            synced += 1
            _store_grad(p, summed)
    return synced


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def _store_grad(param: nn.Parameter, summed: torch.Tensor) -> None:
    """Write a summed flat gradient back into `param.grad`, creating it where this rank had none."""
    local_param = _local(param)
    grad = _local(param.grad)
    if grad is not None:
        grad.copy_(summed.view_as(grad))
        return
    value = summed.view(local_param.shape).clone()
    if isinstance(param, DTensor):
        value = DTensor.from_local(
            value,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    param.grad = value


# ----------------------------------------------------------------------------- shard placement
class _DimPlacement:
    """A built-in shard placement; FSDP2 calls it once per parameter of a unit.

    FSDP2 pads only dim 0 for uneven shards and refuses an uneven split of any other dim, so a
    requested dim > 0 that the shard count does not divide falls back to dim 0 (recorded in
    `fallbacks` and logged once per `apply_fsdp*` call).
    """

    def __init__(self, name: str, shard_size: int) -> None:
        self.name = name
        self.shard_size = shard_size
        self.fallbacks: list[tuple[int, ...]] = []

    def __call__(self, param: nn.Parameter) -> Shard | None:
        shape = tuple(param.shape)
        if not shape:
            return None
        if self.name == "shard_by_dim_0" or len(shape) == 1:
            return Shard(0)
        if self.name == "shard_by_dim_1":
            if shape[1] % self.shard_size == 0:
                return Shard(1)
            self.fallbacks.append(shape)
            return Shard(0)

        # shard_largest_dim: the largest dim that divides evenly (dim 0 always may), first of equals.
        def size(d: int) -> tuple[int, int]:
            return shape[d], -d

        allowed = [0, *(d for d in range(1, len(shape)) if shape[d] % self.shard_size == 0)]
        best = max(allowed, key=size)
        if best != max(range(len(shape)), key=size):
            self.fallbacks.append(shape)
        return Shard(best)

    def __repr__(self) -> str:
        return f"{self.name}(shards={self.shard_size})"


def resolve_shard_placement(
    spec: str | None,
    *,
    shard_size: int,
    key_path: str = "parallelism.shard_placement_fn",
) -> PlacementFn | None:
    """The `shard_placement_fn` FSDP2 gets for `parallelism.shard_placement_fn`.

    Args:
        spec: None (FSDP's default, dim 0); `shard_by_dim_0`; `shard_by_dim_1` (dim 1 where
            the shard count divides it, else dim 0: FSDP2 refuses uneven shards of dims > 0);
            `shard_largest_dim` (the largest dim that divides, else dim 0); or a user function
            `package.module:function` / `package.module.function` taking an `nn.Parameter` and
            returning a `torch.distributed.tensor.Shard` or None (None = dim 0).
        shard_size: the number of shards (the size of the mesh's shard axis).
        key_path: the config key, for messages.

    Returns:
        The placement function, or None for FSDP's default.

    Raises:
        ValueError: `<key_path>: ...` for an unknown name, a module that does not import, or
            an attribute that is missing or not callable.
    """
    if spec is None:
        return None
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{key_path}: expected a placement name or 'package.module:function', got {spec!r}")
    spec = spec.strip()
    if spec in SHARD_PLACEMENTS:
        return _DimPlacement(spec, shard_size)
    valid = ", ".join(SHARD_PLACEMENTS)
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        import difflib

        close = difflib.get_close_matches(spec, SHARD_PLACEMENTS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"{key_path}: unknown shard placement {spec!r}{hint}; expected one of {valid}, or a "
            "function 'package.module:function' taking a parameter and returning Shard(dim) or None"
        )
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"{key_path}: cannot import {module_name!r} for {spec!r} ({e}); expected one of {valid}, "
            "or an importable 'package.module:function'"
        ) from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{key_path}: {module_name!r} has no attribute {attr!r} (from {spec!r})")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{key_path}: {spec!r} is a {type(target).__name__}, not a function")
    return _checked_user_placement(target, spec, key_path)


def _checked_user_placement(fn: Callable[[nn.Parameter], Any], spec: str, key_path: str) -> PlacementFn:
    def placement(param: nn.Parameter) -> Shard | None:
        out = fn(param)
        if out is not None and not isinstance(out, Shard):
            raise TypeError(
                f"{key_path}: {spec} returned {out!r} for a parameter of shape {tuple(param.shape)}; "
                "expected torch.distributed.tensor.Shard(dim) or None"
            )
        return out

    placement.__name__ = spec
    return placement


def _shard_size(mesh: DeviceMesh) -> int:
    # FSDP shards over the last axis of a 2-D (replicate, shard) HSDP mesh.
    return mesh.size(mesh.ndim - 1)


def _log_fallbacks(placement: PlacementFn | None) -> None:
    fallbacks = getattr(placement, "fallbacks", None)
    if fallbacks:
        log.info(
            "%r: %d parameters sharded on another dim than asked (that dim does not divide into "
            "equal shards, which FSDP2 needs for dims > 0), e.g. shapes %s",
            placement,
            len(fallbacks),
            ", ".join(str(s) for s in fallbacks[:3]),
        )


def _few(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")
