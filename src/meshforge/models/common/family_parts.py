"""The pieces of a ``FamilySpec``, made from module paths so that a family's ``spec.py`` is a list.

A spec must stay light (the registry and the torch-free config checks import every spec), so each
heavy piece is a function that imports its module only when called. The makers below write those
functions once: a spec names ``"meshforge.models.qwen3.model:build_qwen3"`` and gets a builder
that imports the model module on the first build. ``tests/unit/test_family_spec.py`` calls every
piece of every registered spec, so a wrong path fails there, not in a user's run.

The ready-made pieces of the ``DecoderModel`` families (stage preparation, CP and KV-cache
modules), the grouped experts and the router aux-loss reduction are here too.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel.style import ParallelStyle

    from meshforge.models.common.stage import LayerRunner, StageBatch
    from meshforge.models.spec import (
        CPModules,
        FamilySpec,
        HFStateDictAdapter,
        KVCacheModules,
        ModelArgs,
        RecurrentState,
        TPPlan,
    )


def load(path: str) -> Any:
    """The object ``path`` (``"package.module:name"``) names, importing its module.

    Raises:
        ValueError: For a path without ``:``.
    """
    module, sep, name = path.partition(":")
    if not sep or not name:
        raise ValueError(f"{path!r}: a spec piece is written 'package.module:name'")
    return getattr(importlib.import_module(module), name)


def builder(path: str, args_type: type) -> Callable[[ModelArgs, str | torch.device], nn.Module]:
    """``FamilySpec.builder``: calls ``path(args, device=device)`` with the family's own args.

    Args:
        path: The family's build function, ``(args, *, device) -> model``.
        args_type: The family's args dataclass (anything else is a caller's bug: TypeError).
    """

    def build(args: ModelArgs, device: str | torch.device) -> nn.Module:
        if not isinstance(args, args_type):
            raise TypeError(f"{path} builds from {args_type.__name__}, got {type(args).__name__}")
        model: nn.Module = load(path)(args, device=device)
        return model

    return build


def tp_plan(module: str) -> TPPlan:
    """``FamilySpec.tp_plan``: the ``checked_tp_plan`` of the family's ``parallelize`` module."""

    def plan(
        model: nn.Module, *, tp: int, sequence_parallel: bool, loss_parallel: bool
    ) -> dict[str, ParallelStyle]:
        checked = load(f"{module}:checked_tp_plan")
        styles: dict[str, ParallelStyle] = checked(
            model, tp=tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
        )
        return styles

    return plan


def adapter(path: str) -> Callable[[FamilySpec, ModelArgs | None], HFStateDictAdapter]:
    """``FamilySpec.adapter``: ``path(spec, args)`` (an adapter class or a factory function)."""

    def make(spec: FamilySpec, args: ModelArgs | None) -> HFStateDictAdapter:
        made: HFStateDictAdapter = load(path)(spec, args)
        return made

    return make


def stage(path: str) -> Callable[[StageBatch], LayerRunner]:
    """``FamilySpec.stage_preparation``: the family's own ``StageBatch -> run(layer, h)``."""

    def prepare(b: StageBatch) -> LayerRunner:
        run: LayerRunner = load(path)(b)
        return run

    return prepare


def module_class(path: str) -> Callable[[], type[nn.Module]]:
    """A function returning the module class at ``path`` (``MoESpec.expert_type``)."""

    def cls() -> type[nn.Module]:
        found: type[nn.Module] = load(path)
        return found

    return cls


def cp_modules(decoder: str, *, mixers: tuple[str, ...] = ()) -> Callable[[], CPModules]:
    """``FamilySpec.cp_modules`` of a family with its own inner model (and recurrent mixers)."""

    def modules() -> CPModules:
        from meshforge.models.spec import CPModules

        return CPModules(
            decoders=(load(decoder),), attentions=attention_classes(), mixers=tuple(map(load, mixers))
        )

    return modules


def kv_cache_modules(
    decoder: str,
    *,
    masks_by_layer_kind: bool = False,
    recurrent: str | None = None,
    new_state: str | None = None,
    mixer_attributes: tuple[str, ...] = ("self_attn",),
) -> Callable[[], KVCacheModules]:
    """``FamilySpec.kv_cache`` of a family with its own inner model (see ``KVCacheModules``)."""

    def modules() -> KVCacheModules:
        from meshforge.models.spec import KVCacheModules

        state: Callable[[], RecurrentState] | None = load(new_state) if new_state else None
        return KVCacheModules(
            decoders=(load(decoder),),
            masks_by_layer_kind=masks_by_layer_kind,
            recurrent=(load(recurrent),) if recurrent else (),
            new_state=state,
            mixer_attributes=mixer_attributes,
        )

    return modules


# ------------------------------------------------------------------ pieces several families share
def decoder_stage(b: StageBatch) -> LayerRunner:
    """``DecoderModel``'s stage preparation (``meshforge.models.common.stage.decoder_stage``)."""
    from meshforge.models.common.stage import decoder_stage as prepare

    return prepare(b)


def attention_classes() -> tuple[type[nn.Module], ...]:
    """The shared attention modules that call a CP plan instead of their own attention."""
    from meshforge.models.common.attention import Attention
    from meshforge.models.common.mla import MultiHeadLatentAttention
    from meshforge.models.common.sink_attention import SinkAttention

    return (Attention, MultiHeadLatentAttention, SinkAttention)


#: CP modules of the ``DecoderModel`` families: the decoder builds the mask, attentions use it.
decoder_cp_modules = cp_modules("meshforge.models.common.causal_lm:DecoderModel")

#: KV-cache modules of the ``DecoderModel`` families: one ``decode_mask``, attention mixers only.
decoder_kv_cache = kv_cache_modules("meshforge.models.common.causal_lm:DecoderModel")

#: ``GroupedExperts``: the fused experts container of several MoE families.
grouped_experts = module_class("meshforge.models.common.moe:GroupedExperts")


def aux_reduce(model: nn.Module, mesh: DeviceMesh) -> None:
    """Sum the router aux statistics of ``model`` over ``mesh`` (``set_aux_reduce_group``)."""
    from meshforge.models.common.moe import set_aux_reduce_group

    set_aux_reduce_group(model, mesh)


__all__ = [
    "adapter",
    "attention_classes",
    "aux_reduce",
    "builder",
    "cp_modules",
    "decoder_cp_modules",
    "decoder_kv_cache",
    "decoder_stage",
    "grouped_experts",
    "kv_cache_modules",
    "load",
    "module_class",
    "stage",
    "tp_plan",
]
