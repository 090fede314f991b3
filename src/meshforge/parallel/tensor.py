"""Tensor parallelism (TP) with sequence parallelism (SP) and loss parallelism, on DTensor.

`apply_tp` turns a model (on the meta device or real) into its tensor-parallel form in place with
PyTorch's `parallelize_module`, the Megatron layout torchtitan uses:

| module                         | style (SP on)                                             |
| ------------------------------ | --------------------------------------------------------- |
| `model.embed_tokens`           | RowwiseParallel: vocab-sharded table, output Shard(1)     |
| `*_layernorm`, `model.norm`    | SequenceParallel: replicated weight, tokens split by seq  |
| `self_attn`, `mlp` (inputs)    | PrepareModuleInput: all-gather the sequence (Shard(1) -> Replicate) |
| `q/k/v_proj`, `gate/up_proj`   | ColwiseParallel: each rank holds whole heads / a slice of the MLP |
| `o_proj`, `down_proj`          | RowwiseParallel, output Shard(1) (a reduce-scatter)       |
| `q_norm`, `k_norm` (per head)  | SequenceParallel over the head dim: replicated weight, grads summed over TP |
| `lm_head`                      | ColwiseParallel: vocab-sharded; output Shard(-1) under loss parallel, else Replicate |

Without SP the norms stay plain modules on replicated activations and the row-wise outputs are
all-reduced (Replicate). The MindFormers reference requires `sequence_parallel` with TP, and the
trainer always passes `sequence_parallel=True`; `False` is kept for tests and pattern plans.

Tied input/output embeddings work: the embedding's RowwiseParallel and the head's ColwiseParallel
both shard the `[vocab, hidden]` weight on dim 0, so one DTensor serves both (re-tied after
`parallelize_module`, which gives each module a new parameter).

Built-in families get their plan from their spec (`FamilySpec.tp_plan`, written in
`meshforge.models.<family>.parallelize` with the pieces of `meshforge.models.common.tp_plan`; qwen3
and llama share the dense decoder plan; qwen3 adds its per-head q/k norms; qwen3_moe keeps its
routed experts whole on every rank, see its module). Every built-in family has a plan: deepseek_v3
(latent attention by heads), gpt_oss (sink attention with its sinks by heads) and qwen3_next
(gated attention and Gated DeltaNet by heads) start from the same plan, keep their MoE blocks
whole like qwen3_moe, and give their token mixers a `SplitHeads` style: local head counts set
on the module, per-head parameters that no `nn.Linear` owns split with the heads or kept whole
with their gradients summed over TP. A family without a plan of its own (the transformers path,
`models/generic/`) gives `FamilySpec.pattern_tp_plan` instead: `apply_tp` matches the
`parallelism.tp_colwise` / `tp_rowwise` module patterns and the spec turns the matched modules
into styles, without SP.

Two fix-ups keep the result usable downstream: every gradient is brought back to its parameter's
layout (DTensor leaves the embedding's Replicate and the norms' Partial), and the embedding output
is copied once so that `torch.compile`d layers (`kernels.compile`) backpropagate correctly.
Pipeline stages see SP-split hidden states; `sequence_shards` tells them the split.

Loss parallelism: `meshforge.loss.cross_entropy.cross_entropy_sum` accepts the vocab-sharded DTensor logits and
returns a plain 0-dim tensor (it computes the softmax statistics with two all-reduces over the TP
group and never gathers the logits), inside or outside `loss_parallel_context`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from meshforge.models.common.tp_plan import (
    TP_KEY,
    SplitHeads,
    attention_input,
    check_divisible,
    decoder_tp_plan,
)

if TYPE_CHECKING:
    from meshforge.models.spec import FamilySpec, PatternTPPlan

__all__ = [
    "SplitHeads",
    "apply_tp",
    "attention_input",
    "check_divisible",
    "decoder_tp_plan",
    "loss_parallel_context",
    "sequence_shards",
]

_TP_KEY = TP_KEY
# Set on the inner model by `apply_tp` under SP: how many ranks split the sequence dim of the
# hidden states between blocks (`sequence_shards`).
_SP_ATTR = "sequence_parallel_shards"


def sequence_shards(model: nn.Module) -> int:
    """Over how many TP ranks `model`'s hidden states are split along the sequence (1: not split).

    Code that sees the hidden states between blocks (a pipeline stage's input) multiplies their
    local length by this to get the full sequence length (e.g. for the RoPE table). Accepts the
    causal LM or its inner `model`.
    """
    inner = getattr(model, "model", model)
    return int(getattr(inner, _SP_ATTR, 1))


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """PyTorch's `loss_parallel()` context when `enabled`, else a no-op context.

    `meshforge.loss.cross_entropy.cross_entropy_sum` does not need it (it handles vocab-sharded logits itself,
    and its backward runs outside any context); the context is for code that calls
    `F.cross_entropy` on the sharded logits directly, whose backward must run inside it too.
    """
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _shared_parameters(model: nn.Module) -> list[tuple[str, str]]:
    """`(alias path, first owner path)` for every parameter registered under two names."""
    first: dict[int, str] = {}
    aliases: list[tuple[str, str]] = []
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is None:
                continue
            path = f"{mod_name}.{name}" if mod_name else name
            if id(param) in first:
                if first[id(param)] != path:
                    aliases.append((path, first[id(param)]))
            else:
                first[id(param)] = path
    return aliases


def _retie(model: nn.Module, aliases: list[tuple[str, str]], tp: int) -> None:
    """Point each alias back at its owner's (new) parameter after `parallelize_module`.

    Raises:
        ValueError: when the two names got different layouts (one sharded, the other not, or
            sharded on different dims), which no single parameter can satisfy.
    """
    for alias, owner in aliases:
        mod_path, _, name = alias.rpartition(".")
        module = model.get_submodule(mod_path)
        mine, theirs = getattr(module, name), model.get_parameter(owner)
        if mine is theirs:
            continue
        layout = [getattr(p, "placements", None) for p in (mine, theirs)]
        if layout[0] != layout[1]:
            raise ValueError(
                f"{_TP_KEY}={tp}: {alias} is tied to {owner} (tie_word_embeddings), but tensor "
                f"parallelism gives them different layouts ({layout[0]} vs {layout[1]}); shard both "
                "the same way (the embedding row-wise and lm_head column-wise both split the vocabulary) "
                "or neither, or untie the embeddings"
            )
        setattr(module, name, theirs)


def _swap_in_local(module: nn.Module, _args: tuple[object, ...]) -> None:
    """Forward pre-hook: the module computes with the local (full) tensors of its replicated weights."""
    stash: dict[str, DTensor] = {}
    names: tuple[str, ...] = module.__dict__["_meshforge_tp_local"]
    for name in names:
        param = module._parameters.get(name)
        if isinstance(param, DTensor):
            stash[name] = param
            # Differentiable: the gradient flows back into the DTensor parameter (Replicate).
            module._parameters[name] = param.to_local()
    module.__dict__["_meshforge_tp_stash"] = stash


def _swap_back(module: nn.Module, _args: tuple[object, ...], _output: object) -> None:
    for name, param in module.__dict__.pop("_meshforge_tp_stash", {}).items():
        module._parameters[name] = param


def _replicate_leftover_parameters(model: nn.Module, tp_mesh: DeviceMesh) -> list[str]:
    """Turn the parameters the plan left plain into replicated DTensors on the TP mesh.

    Some modules run whole on every TP rank over replicated activations: qwen3_moe's routed
    experts and router, and under a pattern plan whatever the patterns do not split (embedding,
    norms, head). Their gradients are the same on every rank, so their math needs no DTensor;
    but every parameter must be one for the rest of the stack: the fused optimizer refuses a
    mix of plain tensors and DTensors, and FSDP then shards all of them on one 2-D mesh. Each
    owner module gets hooks that swap in the local tensors for its forward and back after it.

    Returns:
        The dotted names of the converted parameters.
    """
    converted: dict[int, nn.Parameter] = {}
    names: list[str] = []
    for mod_name, module in model.named_modules():
        local = []
        for name, param in list(module._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            new = converted.get(id(param))
            if new is None:
                dt = DTensor.from_local(param.detach(), tp_mesh, [Replicate()], run_check=False)
                new = converted[id(param)] = nn.Parameter(dt, requires_grad=param.requires_grad)
            module._parameters[name] = new
            local.append(name)
            names.append(f"{mod_name}.{name}" if mod_name else name)
        if local:
            module.__dict__["_meshforge_tp_local"] = tuple(local)
            module.register_forward_pre_hook(_swap_in_local)
            module.register_forward_hook(_swap_back)
    return names


# Marks a parameter whose gradient hook `_match_grad_layouts` has registered.
_GRAD_HOOK_FLAG = "_meshforge_tp_grad_layout"


def _grad_to_layout(grad: torch.Tensor, *, mesh: DeviceMesh, placements: tuple) -> torch.Tensor:
    if isinstance(grad, DTensor) and grad.device_mesh == mesh and grad.placements != placements:
        return grad.redistribute(mesh, placements)
    return grad


def _hook_new_parameters(module: nn.Module, _args: tuple[object, ...]) -> None:
    for param in module.parameters():
        if isinstance(param, DTensor) and param.requires_grad and not getattr(param, _GRAD_HOOK_FLAG, False):
            param.register_hook(
                functools.partial(_grad_to_layout, mesh=param.device_mesh, placements=param.placements)
            )
            setattr(param, _GRAD_HOOK_FLAG, True)


def _match_grad_layouts(model: nn.Module) -> None:
    """Make every TP parameter's gradient arrive in the parameter's own layout.

    DTensor's backward leaves some gradients in another layout than their parameter: the
    vocab-sharded embedding gets a Replicate (full) gradient, and replicated weights used on split
    activations (norms, per-head norms) get a Partial (not yet summed) one. The optimizer would
    cope, but code that works on local shards (the pipeline's tied-embedding sum, gradient
    clipping) needs `grad.to_local()` to be this rank's slice of the true gradient. The fix-up is
    a local slice for Replicate -> Shard and one small all-reduce for Partial -> Replicate.

    The gradient hooks are registered at each forward on parameters that have none yet, because
    materialisation (`to_empty`) creates new parameter objects after `apply_tp`. Under FSDP the
    hooks never fire (FSDP sets the gradients of its sharded parameters itself, converting them).
    """
    model.register_forward_pre_hook(_hook_new_parameters)


def _copy_local_output(_module: nn.Module, _args: tuple[object, ...], output: object) -> object:
    """Forward hook on the embedding: hand the layers a copy of the TP output, not `to_local()`'s alias.

    With `torch.compile`d decoder layers (`kernels.compile`), a compiled region whose input is
    the alias `to_local()` returns breaks the backward (torch 2.13: the DTensor redistribution
    behind it receives a plain-tensor gradient, "'Tensor' object has no attribute
    '_local_tensor'"); a fresh tensor avoids it. One `[batch, seq/tp, hidden]` copy per forward.
    """
    if isinstance(output, torch.Tensor) and not isinstance(output, DTensor):
        return output.clone()
    return output


def _sequence_check_hook(tp: int) -> Callable[[nn.Module, tuple[object, ...]], None]:
    """Forward pre-hook on the embedding: SP splits the sequence evenly over the TP ranks."""

    def hook(_module: nn.Module, args: tuple[object, ...]) -> None:
        ids = args[0] if args else None
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2 and ids.shape[1] % tp:
            raise ValueError(
                f"{_TP_KEY}={tp} with sequence parallelism splits each sequence over the TP ranks: the "
                f"sequence length ({ids.shape[1]}) must be a multiple of {tp}; set the dataset's seq_length "
                "accordingly"
            )

    return hook


def _refuse_custom_patterns(family: str, colwise: list[str] | None, rowwise: list[str] | None) -> None:
    """A family with its own plan: custom `tp_colwise`/`tp_rowwise` would be ignored."""
    from meshforge.parallel.config import MS_TP_COLWISE, MS_TP_ROWWISE

    for key, given, default in (
        ("tp_colwise", colwise, MS_TP_COLWISE),
        ("tp_rowwise", rowwise, MS_TP_ROWWISE),
    ):
        if given is not None and list(given) != list(default):
            raise ValueError(
                f"parallelism.{key}: module patterns drive tensor parallelism on the generic transformers "
                f"path only; the built-in {family} family has its own plan "
                f"(meshforge/models/{family}/parallelize.py); leave {key} at its default"
            )


def _family_spec(family: str | FamilySpec) -> FamilySpec:
    """The spec of `family` (a built-in family's name, or a spec).

    Raises:
        NotImplementedError: an unknown family name.
    """
    from meshforge.models.registry import built_families, resolve_family

    if not isinstance(family, str):
        return family
    try:
        return resolve_family(model_type=family)
    except ValueError:
        raise NotImplementedError(
            f"not supported yet: {_TP_KEY} > 1 for family {family!r} (built: "
            f"{', '.join(built_families())}, or the transformers path's spec with parallelism.tp_colwise/tp_rowwise)"
        ) from None


def _pattern_plan(
    model: nn.Module,
    plan: PatternTPPlan,
    tp: int,
    *,
    colwise: list[str],
    rowwise: list[str],
    loss_parallel: bool,
) -> dict[str, ParallelStyle]:
    """A spec's plan of the modules the `tp_colwise` / `tp_rowwise` patterns match.

    Raises:
        ValueError: a pattern matches nothing (naming its key), or what the plan raises.
    """
    from meshforge.utils.patterns import match_modules

    col = match_modules(model, list(colwise), key_path="parallelism.tp_colwise") if colwise else []
    row = match_modules(model, list(rowwise), key_path="parallelism.tp_rowwise") if rowwise else []
    return plan(model, tp=tp, colwise=col, rowwise=row, loss_parallel=loss_parallel)


def _disable_shared_autograd_cache() -> None:
    """Turn off torch.compile's AOTAutograd cache in this process (TP with `kernels.compile`).

    A compiled TP layer is a rank-specific graph (e.g. the backward of an all-gather keeps this
    rank's sequence slice, its index baked in), but the cache keys DTensor inputs by their global
    spec, the same on every rank (pytorch/pytorch#188390; the upstream fix adds the device, which
    CPU ranks share). With the cache directory shared by the ranks, one rank then loads another's
    compiled backward: measured on 2 gloo ranks, 5-80% wrong gradients for a layer with a whole
    (replicated) MoE block. Compiling each rank's graphs itself costs the cache's saving only.
    """
    import torch._functorch.config as functorch_config

    functorch_config.enable_autograd_cache = False


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    family: str | FamilySpec,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    colwise: list[str] | None = None,
    rowwise: list[str] | None = None,
) -> None:
    """Shard `model` in place over `tp_mesh` (1-D) with tensor parallelism.

    Args:
        model: a family's `*ForCausalLM` (meta or real tensors); a pipeline stage with some
            modules removed works too.
        tp_mesh: the "tp" mesh view.
        family: the model's family: its spec (`FamilySpec.tp_plan`, or `pattern_tp_plan`
            driven by the patterns), or a built-in family's name.
        sequence_parallel: sequence-split activations between the attention and MLP blocks
            (plans of the family's own; a pattern plan has none).
        loss_parallel: keep the logits vocab-sharded (`Shard(-1)` DTensor) for
            `meshforge.loss.cross_entropy.cross_entropy_sum`, instead of gathering them.
        colwise: `parallelism.tp_colwise` patterns (a pattern plan; a family with its own plan
            refuses anything but the default, which that plan stands for).
        rowwise: `parallelism.tp_rowwise` patterns (likewise).

    Raises:
        NotImplementedError: an unknown family, or one with no TP plan.
        ValueError: a size TP splits is not divisible by the TP degree, a pattern is invalid
            (or custom for a built-in family), or tied weights would get different layouts.
    """
    tp = tp_mesh.size()
    aliases = _shared_parameters(model)
    spec = _family_spec(family)
    if spec.tp_plan is None and spec.pattern_tp_plan is not None:
        plan = _pattern_plan(
            model,
            spec.pattern_tp_plan,
            tp,
            colwise=colwise or [],
            rowwise=rowwise or [],
            loss_parallel=loss_parallel,
        )
        sequence_parallel = False
    elif spec.tp_plan is not None:
        _refuse_custom_patterns(spec.name, colwise, rowwise)
        plan = spec.tp_plan(model, tp=tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    else:
        raise NotImplementedError(
            f"not supported yet: {_TP_KEY} > 1 for {spec.name} (no tensor-parallel plan)"
        )
    parallelize_module(model, tp_mesh, plan)
    _disable_shared_autograd_cache()
    _replicate_leftover_parameters(model, tp_mesh)
    _retie(model, aliases, tp)
    _match_grad_layouts(model)
    inner = getattr(model, "model", None)
    if sequence_parallel and isinstance(inner, nn.Module):
        setattr(inner, _SP_ATTR, tp)
    embed = getattr(inner, "embed_tokens", None)
    if isinstance(embed, nn.Module) and "model.embed_tokens" in plan:
        embed.register_forward_hook(_copy_local_output)
    if sequence_parallel and isinstance(embed, nn.Module):
        # Before the RowwiseParallel input hook, so an uneven length fails before any collective.
        embed.register_forward_pre_hook(_sequence_check_hook(tp), prepend=True)
