"""Spec pieces several families share, each importing its torch module only when called.

A family's ``spec.py`` names these in its ``FamilySpec`` (the ``DecoderModel`` families' stage
preparation and CP modules, the grouped experts, the router aux-loss reduction); this module
stays light so the registry imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from meshforge.models.common.stage import LayerRunner, StageBatch
    from meshforge.models.spec import CPModules


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


def decoder_cp_modules() -> CPModules:
    """CP modules of the ``DecoderModel`` families: the decoder builds the mask, attentions use it."""
    from meshforge.models.common.causal_lm import DecoderModel
    from meshforge.models.spec import CPModules

    return CPModules(decoders=(DecoderModel,), attentions=attention_classes())


def grouped_experts() -> type[nn.Module]:
    """``GroupedExperts``: the fused experts container of qwen3_moe, qwen3_next and deepseek_v3."""
    from meshforge.models.common.moe import GroupedExperts

    return GroupedExperts


def aux_reduce(model: nn.Module, mesh: DeviceMesh) -> None:
    """Sum the router aux statistics of ``model`` over ``mesh`` (``set_aux_reduce_group``)."""
    from meshforge.models.common.moe import set_aux_reduce_group

    set_aux_reduce_group(model, mesh)


__all__ = ["attention_classes", "aux_reduce", "decoder_cp_modules", "decoder_stage", "grouped_experts"]
