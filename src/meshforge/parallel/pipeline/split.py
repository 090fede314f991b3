"""Pruning a meta model in place to the pipeline stages one rank runs (global names kept)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from meshforge.parallel.pipeline.layout import (
    SCHEDULE_KEY,
    SCHEDULES,
    PipelineSplit,
    assign_layers,
    canonical_schedule,
)
from meshforge.parallel.pipeline.stage import _PipelinedCausalLM, pipelined_class

if TYPE_CHECKING:
    from meshforge.models.common.stage import LayerRunner, StageBatch
    from meshforge.models.spec import FamilySpec


def _check_supported(model: nn.Module, spec: FamilySpec | None) -> Callable[[StageBatch], LayerRunner]:
    """The stage preparation of ``model``'s family (``FamilySpec.stage_preparation``), or refuse.

    Raises:
        NotImplementedError: The family has none, or its ``stage_check`` refuses the model.
        ValueError: The model is already split.
    """
    if isinstance(model, _PipelinedCausalLM):
        raise ValueError("split_model: the model is already split (model.layers is not a ModuleList)")
    if spec is not None and spec.stage_check is not None and spec.stage_preparation is not None:
        spec.stage_check(model)
        return spec.stage_preparation
    family = getattr(model, "family", None) or getattr(getattr(model, "config", None), "model_type", None)
    family = family or type(model).__name__
    inner = getattr(model, "model", None)
    prepare = spec.stage_preparation if spec is not None else None
    if inner is None or prepare is None:
        raise NotImplementedError(f"not supported yet: parallelism.pipeline_parallel > 1 for {family}")
    if not isinstance(inner.layers, nn.ModuleList):
        raise ValueError("split_model: the model is already split (model.layers is not a ModuleList)")
    return prepare


def _tied(model: nn.Module, inner: Any) -> bool:
    """Whether ``lm_head`` shares the embedding's weight: the family's args say so, or the two
    modules hold one Parameter (transformers ties that way, by ``tie_word_embeddings`` or its
    own rules)."""
    if bool(getattr(getattr(model, "args", None), "tie_word_embeddings", False)):
        return True
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    return head is not None and head is getattr(inner.embed_tokens, "weight", None)


def split_model(
    model: nn.Module,
    *,
    pp_rank: int,
    pp_size: int,
    layers_per_stage: Any = "auto",
    interleave: int = 1,
    schedule: str = "1f1b",
    family: FamilySpec | None = None,
) -> PipelineSplit:
    """Decide every stage's layers and prune ``model`` in place to what ``pp_rank`` runs.

    Call it on the meta model, before TP, FSDP and materialisation.

    Args:
        model: A ``CausalLM`` of a family with a stage preparation (and a layout its
            ``stage_check`` accepts, for the transformers path).
        pp_rank: This rank's index on the pp mesh.
        pp_size: Pipeline ranks (``parallelism.pipeline_parallel``).
        layers_per_stage: ``parallelism.pipeline_parallel_layers_per_stage`` (see ``assign_layers``).
        interleave: ``parallelism.pipeline_parallel_interleave_num`` (stages per rank).
        schedule: ``parallelism.pipeline_parallel_schedule`` (decides the stage placement and
            whether several stages per rank are allowed).
        family: The model's spec (None: the registry's ``spec_of_model``).

    Returns:
        The split; ``split.model`` is ``model``, pruned: ``model.layers`` is a ModuleDict keyed by
        global layer index, ``embed_tokens`` is None unless this rank runs stage 0, ``norm`` and
        ``lm_head`` are None unless it runs the last stage.

    Raises:
        NotImplementedError: for families without pipeline support.
        ValueError: naming the config key for an invalid layout.
    """
    if family is None:
        from meshforge.models.registry import spec_of_model

        family = spec_of_model(model)
    prepare = _check_supported(model, family)
    name = canonical_schedule(schedule)
    _, stages_per_rank, placement = SCHEDULES[name]
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"split_model: pp_rank {pp_rank} is not in [0, {pp_size})")
    if interleave < 1:
        raise ValueError(f"parallelism.pipeline_parallel_interleave_num: must be >= 1, got {interleave}")
    if stages_per_rank == "one" and interleave != 1:
        raise ValueError(
            f"parallelism.pipeline_parallel_interleave_num: {interleave} stages per rank need an interleaved "
            f"schedule ({SCHEDULE_KEY}: interleaved or zero_bubble), not {schedule!r}"
        )
    if name == "zbv" and interleave != 2:
        raise ValueError(
            f"parallelism.pipeline_parallel_interleave_num: the zbv schedule runs exactly 2 stages per rank, "
            f"got {interleave}"
        )
    inner: Any = model.model
    num_layers = len(inner.layers)
    # DeepSeek-V3's MTP blocks follow its decoder layers in model.layers: the last stage runs them.
    decoder_layers = getattr(inner, "num_decoder_layers", num_layers)
    mtp = list(range(decoder_layers, num_layers))
    num_layers = decoder_layers
    tied_model = _tied(model, inner)
    all_stages = assign_layers(
        num_layers,
        pp_size=pp_size,
        layers_per_stage=layers_per_stage,
        interleave=interleave,
        placement=placement,
    )
    local = [s for s in all_stages if s.rank == pp_rank]
    first_rank, last_rank = all_stages[0].rank, all_stages[-1].rank
    hosted = sorted(i for s in local for i in s.layers) + (mtp if pp_rank == last_rank else [])
    old_layers = inner.layers
    inner.layers = nn.ModuleDict({str(i): old_layers[i] for i in hosted})
    embedding_copy = bool(mtp) and first_rank != last_rank
    if pp_rank != first_rank and not (embedding_copy and pp_rank == last_rank):
        inner.embed_tokens = None
    if pp_rank != last_rank:
        inner.norm = None
        # torch types nn.Module.__setattr__'s value Tensor | Module; None empties a submodule slot.
        model.lm_head = None  # type: ignore[assignment]
    # With the embedding gone, a tied lm_head.weight is now a parameter of its own on this rank.
    tied = tied_model and first_rank != last_rank
    model.__class__ = pipelined_class(type(model), prepare)
    # The class just swapped puts _PipelinedCausalLM in front.
    cast(_PipelinedCausalLM, model)._pp_stages = {s.index: s for s in local}
    return PipelineSplit(
        model=model,
        stages=local,
        all_stages=all_stages,
        pp_rank=pp_rank,
        pp_size=pp_size,
        interleave=interleave,
        schedule=name,
        tied_across_ranks=tied,
        mtp_layers=len(mtp),
        embedding_copy=embedding_copy,
    )


__all__ = ["split_model"]
