"""The tensor-parallel plan pieces every family's plan is written with (Megatron/torchtitan layout).

``decoder_tp_plan`` is the dense pre-norm decoder's ``{module path: ParallelStyle}`` plan
(column-split q/k/v and gate/up, row-split o/down, vocab-split embedding and head,
sequence-parallel norms); ``SplitHeads`` makes a token mixer work on its local heads;
``attention_input`` all-gathers a mixer's sequence-split input. Each family's
``parallelize.py`` composes them; ``meshforge.parallel.tensor.apply_tp`` applies the result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

if TYPE_CHECKING:
    from meshforge.models.spec import TPPlan

TP_KEY = "parallelism.tensor_parallel"
_TP_KEY = TP_KEY


class DivisibilityError(ValueError):
    """A size the TP plan splits that the degree does not divide; `key` is its config key path,
    `reason` the rest of the message (what `config validate` prints after the key)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key} {reason}")
        self.key = key
        self.reason = reason


def check_divisible(sizes: dict[str, int], tp: int, *, prefix: str = "model") -> None:
    """Raise when a size that TP splits is not a multiple of the TP degree.

    Args:
        sizes: config key (without `prefix`) -> value, e.g. `{"num_key_value_heads": 2}`.
        tp: the tensor-parallel degree.
        prefix: the config section the keys live in.

    Raises:
        DivisibilityError: naming the first offending key and `parallelism.tensor_parallel`.
    """
    for key, value in sizes.items():
        if value % tp:
            raise DivisibilityError(
                f"{prefix}.{key}",
                f"({value}) is not divisible by {_TP_KEY} ({tp}): tensor parallelism "
                f"splits it evenly over the TP ranks; choose a {_TP_KEY} that divides it",
            )


def check_sizes(model: nn.Module, tp: int, sizes: Callable[[Any], dict[str, int]]) -> None:
    """`check_divisible` on the sizes `sizes(model.args)` a family's plan splits (when it has args).

    Raises:
        ValueError: naming the first `model.*` key that `tp` does not divide.
    """
    args = getattr(model, "args", None)
    if args is not None:
        check_divisible(sizes(args), tp)


class PlanBody(Protocol):
    """A family's unchecked plan: ``{module path: ParallelStyle}`` for a model or a pipeline stage."""

    def __call__(
        self, model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool
    ) -> dict[str, ParallelStyle]: ...


def checked_plan(plan: PlanBody, sizes: Callable[[Any], dict[str, int]]) -> TPPlan:
    """The family's ``TPPlan`` (``FamilySpec.tp_plan``): ``sizes`` checked against ``tp``, then ``plan``.

    Every family's plan refuses a TP degree that does not divide a size it splits before it
    builds any style, so the error names the ``model.*`` key instead of a shape mismatch deep
    in ``parallelize_module``.

    Args:
        plan: The family's ``tp_plan(model, *, sequence_parallel, loss_parallel)``.
        sizes: ``args -> {model key: size}`` of the sizes ``plan`` splits (see :func:`check_sizes`).
    """

    def checked(
        model: nn.Module, *, tp: int, sequence_parallel: bool, loss_parallel: bool
    ) -> dict[str, ParallelStyle]:
        check_sizes(model, tp, sizes)
        return plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)

    return checked


def _layer_items(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """`(dotted path, layer)` for every decoder layer (a ModuleList, or a ModuleDict on a PP stage)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no `model.layers`; no tensor-parallel plan applies")
    for name, layer in layers.named_children():
        yield f"model.layers.{name}", layer


def decoder_tp_plan(
    model: nn.Module,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    head_norms: Sequence[str] = (),
    replicated_mlp: Callable[[nn.Module], bool] | None = None,
    replicated_mlp_extra_inputs: int = 1,
) -> dict[str, ParallelStyle]:
    """The `{module path: ParallelStyle}` plan of a dense pre-norm decoder (qwen3, llama).

    The model must have transformers' tree: `model.embed_tokens`, `model.layers.<i>` with
    `input_layernorm`, `self_attn.{q,k,v,o}_proj`, `post_attention_layernorm`,
    `mlp.{gate,up,down}_proj`, then `model.norm` and `lm_head`. Modules a pipeline stage dropped
    (embedding, final norm, head) are left out of the plan.

    Args:
        sequence_parallel: split activations outside attention/MLP along the sequence (Shard(1)).
        loss_parallel: leave the logits vocab-sharded (a Shard(-1) DTensor) for the loss.
        head_norms: names of per-head norms inside `self_attn` (qwen3's `q_norm`, `k_norm`):
            they see only the local heads, so their weight becomes a replicated DTensor whose
            gradient is summed over the TP ranks.
        replicated_mlp: says which layers keep their `mlp` whole (routed experts): it runs on
            every TP rank over all tokens with replicated weights (the same result and gradients
            on each rank, nothing split); under SP its input is all-gathered and each rank keeps
            its own slice of the output.
        replicated_mlp_extra_inputs: how many arguments such a whole `mlp` takes after the hidden
            states (qwen3_moe, gpt_oss: a token mask; deepseek_v3: none); they pass through.
    """
    seq = Shard(1)
    extra = (None,) * replicated_mlp_extra_inputs
    plan: dict[str, ParallelStyle] = {}
    inner = model.model
    if getattr(inner, "embed_tokens", None) is not None:
        plan["model.embed_tokens"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq if sequence_parallel else Replicate()
        )
    for path, layer in _layer_items(model):
        whole_mlp = replicated_mlp is not None and replicated_mlp(layer)
        # A layer with another token mixer (qwen3_next's linear attention) gets its entries from
        # the family's plan; the norms and the MLP are planned here all the same.
        attn = getattr(layer, "self_attn", None)
        if sequence_parallel:
            plan[f"{path}.input_layernorm"] = SequenceParallel()
            plan[f"{path}.post_attention_layernorm"] = SequenceParallel()
            if attn is not None:
                # The attention also takes (cos, sin) and the mask: plain tensors, left as they are.
                plan[f"{path}.self_attn"] = PrepareModuleInput(
                    input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
                )
            if whole_mlp:
                # Extra inputs (a token mask) pass through; the output goes back to this rank's
                # sequence slice (a local chunk; its backward all-gathers the slices' gradients).
                plan[f"{path}.mlp"] = PrepareModuleInputOutput(
                    input_layouts=(seq, *extra),
                    desired_input_layouts=(Replicate(), *extra),
                    output_layouts=(Replicate(),),
                    desired_output_layouts=(seq,),
                    use_local_input=True,
                    use_local_output=True,
                )
            else:
                plan[f"{path}.mlp"] = PrepareModuleInput(
                    input_layouts=(seq,), desired_input_layouts=(Replicate(),)
                )
        if attn is not None:
            for proj in ("q_proj", "k_proj", "v_proj"):
                plan[f"{path}.self_attn.{proj}"] = ColwiseParallel()
            plan[f"{path}.self_attn.o_proj"] = RowwiseParallel(
                output_layouts=seq if sequence_parallel else Replicate()
            )
            for norm in head_norms:
                if getattr(attn, norm, None) is not None:
                    # q/k are [B, S, heads, head_dim] when normed: the local heads are dim 2.
                    plan[f"{path}.self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if not whole_mlp:
            plan[f"{path}.mlp.gate_proj"] = ColwiseParallel()
            plan[f"{path}.mlp.up_proj"] = ColwiseParallel()
            plan[f"{path}.mlp.down_proj"] = RowwiseParallel(
                output_layouts=seq if sequence_parallel else Replicate()
            )
    if sequence_parallel and getattr(inner, "norm", None) is not None:
        plan["model.norm"] = SequenceParallel()
    if getattr(model, "lm_head", None) is not None:
        plan["lm_head"] = ColwiseParallel(
            input_layouts=seq if sequence_parallel else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


class SplitHeads(ParallelStyle):
    """The token mixer itself under TP, around its child projections' plan (one per module).

    Column-split projections hand a mixer only its local heads, but some mixers also reshape
    with head-count attributes, or compute directly with per-head parameters that no
    `nn.Linear` owns. This style makes such a module work on its local heads:

    * `head_attrs` (e.g. MLA's `num_heads`, gpt-oss' `num_heads`/`num_kv_heads`) are divided
      by the TP degree, as torchtitan does, instead of changing the model code;
    * `sharded` parameters (per-head vectors: gpt-oss' `sinks`, Gated DeltaNet's `A_log`) are
      split `Shard(0)` with the heads;
    * `summed` parameters are kept whole (`Replicate`) but each rank uses them on its own heads
      only (a per-head norm's weight, or a slice of them: Gated DeltaNet's conv channels, given
      as a function `(rank, tp) -> index` into dim 0), so their gradient is a partial sum that
      is reduced over the TP ranks;
    * for the forward, the module sees plain local tensors in place of those parameters
      (swapped in by a pre-hook, back after; differentiable, so gradients reach the DTensors);
    * `inner` (the input preparation under SP, `attention_input`) is applied to the module too.

    Names are dotted paths relative to the module (`"conv1d.weight"`).
    """

    def __init__(
        self,
        *,
        head_attrs: Sequence[str] = (),
        sharded: Sequence[str] = (),
        summed: dict[str, Callable[[int, int], torch.Tensor] | None] | None = None,
        inner: ParallelStyle | None = None,
    ) -> None:
        super().__init__()
        self.head_attrs = tuple(head_attrs)
        self.sharded = tuple(sharded)
        self.summed = dict(summed or {})
        self.inner = inner

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        for attr in self.head_attrs:
            value = getattr(module, attr)
            if value % tp:
                raise ValueError(
                    f"{type(module).__name__}.{attr} ({value}) is not divisible by {_TP_KEY} ({tp})"
                )
            setattr(module, attr, value // tp)
        local: list[tuple[str, torch.Tensor | None]] = []
        for name in (*self.sharded, *self.summed):
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path)
            param = owner._parameters[leaf]
            if param is None:
                raise ValueError(f"SplitHeads: {type(module).__name__}.{name} is not a parameter")
            placement = Shard(0) if name in self.sharded else Replicate()
            dist = distribute_tensor(param.data, device_mesh, [placement], src_data_rank=self.src_data_rank)
            owner.register_parameter(leaf, nn.Parameter(dist, requires_grad=param.requires_grad))
            if name in self.sharded:
                local.append((name, None))
            else:
                index = self.summed[name]
                local.append((name, None if index is None else index(rank, tp)))
        if local:
            module.__dict__["_meshforge_tp_split"] = local
            module.register_forward_pre_hook(_swap_in_split)
            module.register_forward_hook(_swap_back_split)
        if self.inner is not None:
            self.inner.src_data_rank = self.src_data_rank
            return self.inner._apply(module, device_mesh)
        return module


def _swap_in_split(module: nn.Module, _args: tuple[object, ...]) -> None:
    """Forward pre-hook of `SplitHeads`: plain local tensors in place of its DTensor parameters."""
    stash: list[tuple[nn.Module, str, DTensor]] = []
    split: list[tuple[str, torch.Tensor | None]] = module.__dict__["_meshforge_tp_split"]
    for i, (name, index) in enumerate(split):
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path)
        param = owner._parameters[leaf]
        if not isinstance(param, DTensor):
            continue
        if param.placements[0].is_shard():
            tensor = param.to_local()  # the gradient is this rank's slice, as the parameter
        else:
            # Used on this rank's heads only: the gradient is one term of a sum over the ranks.
            tensor = param.to_local(grad_placements=(Partial(),))
            if index is not None:
                if index.device != tensor.device:  # once, after the model moved
                    index = index.to(tensor.device)
                    split[i] = (name, index)
                tensor = tensor.index_select(0, index)
        stash.append((owner, leaf, param))
        owner._parameters[leaf] = tensor
    module.__dict__["_meshforge_tp_split_stash"] = stash


def _swap_back_split(module: nn.Module, _args: tuple[object, ...], _output: object) -> None:
    for owner, leaf, param in module.__dict__.pop("_meshforge_tp_split_stash", ()):
        owner._parameters[leaf] = param


class _GatherSequence(ParallelStyle):
    """Forward pre-hook style: all-gather the sequence of a module's first input (Shard(1) -> Replicate).

    Unlike `PrepareModuleInput` it does not fix the number of the other arguments (RoPE tables,
    masks, segment ids, a context-parallel mask), which pass through untouched.
    """

    def __init__(self, *, local: bool) -> None:
        super().__init__()
        self.local = local

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(functools.partial(self._prepare, mesh=device_mesh))
        return module

    def _prepare(
        self, _module: nn.Module, args: tuple[object, ...], *, mesh: DeviceMesh
    ) -> tuple[object, ...]:
        x = args[0]
        assert isinstance(x, torch.Tensor)  # the module's first input: the hidden states
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Shard(1),), run_check=False)
        if x.placements != (Replicate(),):
            x = x.redistribute(mesh, (Replicate(),))
        return (x.to_local() if self.local else x, *args[1:])


def attention_input(*, sequence_parallel: bool, local: bool) -> ParallelStyle | None:
    """The input preparation of a token mixer under SP: all-gather the sequence of its first input.

    Args:
        sequence_parallel: without SP the input is already whole: None (nothing to prepare).
        local: hand the mixer a plain tensor (mixers whose own parameters are plain tensors)
            rather than a replicated DTensor. Its backward treats the gradient as whole
            (Replicate), so every consumer of the input must produce the full gradient (as
            column-split projections do: their input gradient is summed over TP).
    """
    return _GatherSequence(local=local) if sequence_parallel else None


__all__ = [
    "TP_KEY",
    "PlanBody",
    "SplitHeads",
    "attention_input",
    "check_divisible",
    "check_sizes",
    "checked_plan",
    "decoder_tp_plan",
]
