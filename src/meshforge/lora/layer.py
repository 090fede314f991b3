"""Low-rank adapters attached to an existing `nn.Linear`, keeping the base parameter names.

A targeted linear keeps its own `weight` (and `bias`), so Hugging Face loading, the TP plans and
DCP see the base model's names unchanged (`model.layers.0.self_attn.q_proj.weight`). The adapter
is two child linears, `lora_A` (in -> r) and `lora_B` (r -> out), plus `lora_dropout`, named as
PEFT names them once the adapter name is dropped (`...q_proj.lora_A.weight`), and a forward hook
that adds `lora_B(lora_A(dropout(x))) * alpha / r` to the base output.

The hook is prepended to the module's forward hooks: under tensor parallelism it must see the
output while it is still a DTensor (partial sums of a rowwise layer, column shards of a colwise
one), before the TP output hook reduces or converts it. Sharding A and B like the base (see
`adapter_placements`) makes the adapter's output carry the base output's placement, so the base
output needs no extra collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

ADAPTER_CHILDREN = ("lora_A", "lora_B", "lora_dropout")
_SCALING = "lora_scaling"
_DISABLED = "_lora_disabled"


def is_lora_linear(module: nn.Module) -> bool:
    """Whether `module` is a linear layer that carries adapters."""
    return isinstance(module, nn.Linear) and hasattr(module, _SCALING)


def adapter_placements(base: DTensor) -> tuple[list[Placement], list[Placement]]:
    """Placements of A and B for a base weight `[out, in]` sharded over a TP mesh.

    A colwise base (`Shard(0)`, output features split) keeps A whole and splits B's rows, so the
    adapter output is split over the same features as the base output. A rowwise base
    (`Shard(1)`, input features split) splits A's columns and keeps B whole: each rank's adapter
    output is a partial sum, like the base output, and the one reduction the TP layer already
    does covers both.
    """
    a: list[Placement] = []
    b: list[Placement] = []
    for placement in base.placements:
        if isinstance(placement, Shard) and placement.dim == 0:
            a.append(Replicate())
            b.append(Shard(0))
        elif isinstance(placement, Shard) and placement.dim == 1:
            a.append(Shard(1))
            b.append(Replicate())
        else:
            a.append(Replicate())
            b.append(Replicate())
    return a, b


def adapter_part(linear: nn.Module, part: str) -> nn.Linear:
    """`lora_A` or `lora_B` of an adapted linear."""
    sub = linear.get_submodule(part)
    assert isinstance(sub, nn.Linear)
    return sub


def _adapter_forward_hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    if module.__dict__.get(_DISABLED):  # adapters_disabled: the base model's output
        return output
    x = args[0]
    lora_a = adapter_part(module, "lora_A")
    lora_b = adapter_part(module, "lora_B")
    h = module.get_submodule("lora_dropout")(x)
    if h.dtype != lora_a.weight.dtype:
        h = h.to(lora_a.weight.dtype)
    scaling = getattr(module, _SCALING)
    low = lora_a(h)
    b = lora_b.weight
    if not isinstance(output, DTensor) and not isinstance(b, DTensor) and output.dtype == b.dtype:
        # One multiply-add, output + scaling * low @ B^T: no full-width delta, no separate scale
        # and add passes over it.
        width = output.shape[-1]
        fused = torch.addmm(output.reshape(-1, width), low.reshape(-1, low.shape[-1]), b.t(), alpha=scaling)
        return fused.view(output.shape)
    delta = lora_b(low) * scaling
    return output + delta.to(output.dtype)


def _replace_parameter(owner: nn.Linear, placements: list[Placement], base: DTensor) -> None:
    param = owner.weight
    dt = distribute_tensor(
        torch.empty(param.shape, dtype=param.dtype, device=param.device),
        base.device_mesh,
        placements,
        src_data_rank=None,
    )
    owner.weight = nn.Parameter(dt, requires_grad=True)


def add_adapters(linear: nn.Linear, *, rank: int, alpha: int, dropout: float, dtype: torch.dtype) -> None:
    """Give `linear` a rank-`rank` adapter (uninitialised storage; `init_adapter_` fills it).

    Args:
        rank: r, the inner size; the output is scaled by `alpha / rank` as in PEFT.
        dtype: the adapters' dtype (the model's parameter dtype: they are trained).
    """
    if is_lora_linear(linear):
        raise ValueError(f"{type(linear).__name__} already has adapters")
    weight = linear.weight
    device = weight.device
    lora_a = nn.Linear(linear.in_features, rank, bias=False, device=device, dtype=dtype)
    lora_b = nn.Linear(rank, linear.out_features, bias=False, device=device, dtype=dtype)
    if isinstance(weight, DTensor):
        a_place, b_place = adapter_placements(weight)
        _replace_parameter(lora_a, a_place, weight)
        _replace_parameter(lora_b, b_place, weight)
    linear.lora_A = lora_a
    linear.lora_B = lora_b
    linear.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    setattr(linear, _SCALING, alpha / rank)
    # A plain attribute (not a module or tensor): kept in the instance dict for `merge_adapters_`.
    linear.__dict__["_lora_hook"] = linear.register_forward_hook(_adapter_forward_hook, prepend=True)


@torch.no_grad()
def merge_adapters_(model: nn.Module) -> int:
    """Fold every adapter into its base weight (`W += alpha / r * B @ A`) and remove it, in place.

    For inference on a plain (unsharded) model: the result is an ordinary model of the base
    architecture. Returns the number of merged layers.
    """
    merged = 0
    for _, linear in lora_linears(model):
        weight = linear.weight
        if isinstance(weight, DTensor):
            raise ValueError("merge_adapters_: merge before sharding (the weights are DTensors)")
        weight.copy_((weight.float() + full_delta(linear).to(weight.device)).to(weight.dtype))
        for name in ADAPTER_CHILDREN:
            linear._modules.pop(name, None)
        linear.__dict__.pop("_lora_hook").remove()
        delattr(linear, _SCALING)
        merged += 1
    return merged


def init_adapter_(
    name: str, tensor: torch.Tensor, generator: torch.Generator, *, a_std: float, b_std: float
) -> None:
    """Fill one full adapter matrix: normal(0, `lora_a_std`) for A, normal(0, `lora_b_std`) for B (0 -> zeros)."""
    std = a_std if name.split(".")[-2] == "lora_A" else b_std
    if std == 0:
        tensor.zero_()
    else:
        tensor.normal_(0.0, std, generator=generator)


def lora_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """`(module path, linear)` of every adapted linear, in `named_modules()` order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and is_lora_linear(m)]


@contextlib.contextmanager
def adapters_detached(model: nn.Module) -> Iterator[None]:
    """Take the adapter children off for the duration, so the model shows only base parameters.

    For code that walks a model's parameters expecting the base model's keys (the Hugging Face
    loader and exporter); the same module objects are put back, so FSDP and optimizer
    references stay valid. No forward may run inside.
    """
    taken: list[tuple[nn.Module, dict[str, nn.Module | None]]] = []
    for _, linear in lora_linears(model):
        children = {name: linear._modules.pop(name) for name in ADAPTER_CHILDREN if name in linear._modules}
        taken.append((linear, children))
    try:
        yield
    finally:
        for owner, children in taken:
            for name, child in children.items():
                owner._modules[name] = child


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Forwards inside run the base model: every adapter's hook returns the base output unchanged.

    The reference model of preference training with LoRA (the policy with its adapters off, no
    second copy of the weights), as PEFT's `disable_adapter`. Parameters and modules stay as
    they are, so FSDP and the optimizer see nothing change.
    """
    linears = [linear for _, linear in lora_linears(model)]
    for linear in linears:
        linear.__dict__[_DISABLED] = True
    try:
        yield
    finally:
        for linear in linears:
            linear.__dict__.pop(_DISABLED, None)


@torch.no_grad()
def full_delta(linear: nn.Linear) -> torch.Tensor:
    """`alpha / r * B @ A` in full on the CPU, in float32 (a collective for sharded adapters)."""
    a = adapter_part(linear, "lora_A").weight.detach()
    b = adapter_part(linear, "lora_B").weight.detach()
    if isinstance(a, DTensor):
        a = a.full_tensor()
    if isinstance(b, DTensor):
        b = b.full_tensor()
    return (b.float().cpu() @ a.float().cpu()) * float(getattr(linear, _SCALING))
