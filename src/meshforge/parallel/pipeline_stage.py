"""The stage side of pipeline parallelism: what one stage's forward runs, per model family.

``meshforge.parallel.pipeline.split_model`` swaps a pruned model's class for a subclass with
``_PipelinedCausalLM`` in front: its ``forward(..., pp_stage=i)`` runs only stage ``i``'s part
(embedding on the first stage, its decoder layers, norm and head on the last).
``StageModule`` wraps one stage for torch's ``PipelineStage``. ``pipeline.py`` holds the layout,
the pruning, the schedule and the step.

Each family's inner model builds masks and RoPE tables once before its layers; a stage does the
same for its own layers from the micro-batch's ``position_ids``/``segment_ids`` (tiny next to one
layer's compute). One preparation per family (``layer_runner_factory``):

* ``DecoderModel`` families (qwen3, llama, qwen3_moe, deepseek_v3): one mask for every layer, or
  the context-parallel plan's mask object;
* gpt_oss: the full mask, and the sliding-window mask when the stage runs a sliding layer (each
  layer keeps the attention type of its global index), or the CP mask object;
* qwen3_next: the block-diagonal mask for its attention layers; the Gated DeltaNet layers read
  ``segment_ids`` and restart their state and conv window at every document start, on whichever
  stage they run.
* the generic transformers path (``models/generic.py``): the masks transformers' own mask
  functions build for each layer's attention type, the RoPE tables of the model's
  ``rotary_emb`` and the positions, all as ``GenericCausalLMMixin.forward`` would have them
  built, for the model types in ``GENERIC_MASK_RULES`` (``check_generic_layout`` refuses the
  rest by name); under context parallelism (``meshforge_cp``, see ``context_generic``) no mask,
  RoPE from the global positions and the per-forward CP state as each layer's keyword, as the
  wrapper's CP forward.

The MoE router aux loss (see ``pipeline.py``'s module docstring): with it on, every stage also
returns a ``carry`` of running aux totals, ``[prob_sum (E), assignments (E), rows]`` over the
MoE layers run so far for this micro-batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from meshforge.models.common.attention import positions_from_segments
from meshforge.models.common.stage import LayerRunner, StageBatch

if TYPE_CHECKING:
    from meshforge.parallel.pipeline import StageInfo


# The stage batch and the built-in families' preparations live with the models
# (``meshforge.models.common.stage``, each family's ``stage.py``), named by the family spec.
# The generic transformers path: model types whose ``*Model.forward`` (transformers 5.24) is the
# plain recipe a stage reproduces (embed -> masks + RoPE -> layers -> norm, no embedding scale or
# logit scaling), and which mask each of their layers gets:
# * "causal": one ``create_causal_mask`` for every layer;
# * "sliding_window": ``create_sliding_window_causal_mask`` for every layer when
#   ``config.sliding_window`` is set, else the causal one (Mistral);
# * "layer_types": per layer, by ``config.layer_types[global index]`` (full or sliding).
GENERIC_MASK_RULES: dict[str, str] = {
    "llama": "causal",
    "mistral": "sliding_window",
    "qwen2": "layer_types",
    "qwen3": "layer_types",
}
_HF_MASK_FUNCTIONS = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
}


def generic_layer_types(inner: nn.Module, indices: list[int]) -> list[str]:
    """The attention type (``full_attention``/``sliding_attention``) of each global layer index.

    Raises:
        NotImplementedError: for a model type outside ``GENERIC_MASK_RULES`` or a layer type
            other than full or sliding attention.
    """
    config: Any = inner.config
    model_type = getattr(config, "model_type", None)
    rule = GENERIC_MASK_RULES.get(str(model_type))
    if rule is None:
        raise NotImplementedError(
            f"not supported yet: parallelism.pipeline_parallel > 1 for the transformers model type "
            f"{model_type!r} ({type(inner).__name__}); pipeline stages reproduce the forward of "
            f"{', '.join(sorted(GENERIC_MASK_RULES))}"
        )
    if rule == "causal":
        return ["full_attention"] * len(indices)
    if rule == "sliding_window":
        kind = "full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"
        return [kind] * len(indices)
    types = list(getattr(config, "layer_types", None) or [])
    out = []
    for i in indices:
        kind = types[i] if i < len(types) else None
        if kind not in _HF_MASK_FUNCTIONS:
            raise NotImplementedError(
                f"not supported yet: parallelism.pipeline_parallel > 1 for {type(inner).__name__} layer {i} "
                f"of type {kind!r} (config.layer_types); stages build full_attention and sliding_attention masks"
            )
        out.append(kind)
    return out


def check_generic_layout(model: nn.Module) -> None:
    """The generic transformers path: the usual decoder layout and a model type stages reproduce.

    Raises:
        NotImplementedError: naming what the model lacks, or its model type.
    """
    inner: Any = getattr(model, "model", None)
    missing = []
    if not isinstance(inner, nn.Module):
        missing.append("model (the base model)")
    else:
        for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not isinstance(getattr(inner, attr, None), nn.Module):
                missing.append(f"model.{attr}")
        if isinstance(getattr(inner, "layers", None), nn.Module) and not isinstance(
            inner.layers, nn.ModuleList
        ):
            missing.append("model.layers as a ModuleList")
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        missing.append("lm_head")
    if missing:
        raise NotImplementedError(
            f"not supported yet: parallelism.pipeline_parallel > 1 for {type(model).__name__}: the generic "
            "transformers path splits models laid out as model.embed_tokens, model.layers (a ModuleList), "
            f"model.norm, model.rotary_emb and lm_head; this one has no {', '.join(missing)}"
        )
    # Raises for a model type whose forward the stages do not reproduce, or an unknown layer type.
    generic_layer_types(inner, list(range(len(inner.layers))))


def _generic_runner(b: StageBatch) -> LayerRunner:
    """A transformers ``*Model.forward``'s preparation, as ``GenericCausalLMMixin.forward`` calls it.

    The one-process generic forward passes ``segment_ids`` as the block-diagonal causal mask(s) of
    ``meshforge.models.generic.packed_masks`` (``attention_mask``; sliding windows included) and, when no ``position_ids`` are given, positions that restart at every
    document (without ``segment_ids`` transformers counts ``0..S-1``); the masks come from the functions the model's own module calls, with the same
    arguments, so a stage's layers see exactly the masks and RoPE tables they would see there.
    """
    inner, h, position_ids, segment_ids, layers = b.inner, b.h, b.position_ids, b.segment_ids, b.layers
    import inspect
    import sys

    index_of = {id(layer): int(key) for key, layer in inner.layers.items()}
    kinds = generic_layer_types(inner, [index_of[id(layer)] for layer in layers])
    attention_mask: Any = None
    if segment_ids is not None:
        from meshforge.models.generic import packed_masks

        # As the wrapper: the block-diagonal mask with the model's sliding window added (a 4-D
        # mask reaches the attention as it is), one per layer type when the model has them.
        attention_mask = packed_masks(inner.config, segment_ids)
        if position_ids is None:
            # As the wrapper (and the built-in families): positions restart per document.
            position_ids = positions_from_segments(segment_ids)
    if position_ids is None:
        position_ids = torch.arange(b.seq_len, device=h.device).unsqueeze(0)
    module = sys.modules[type(inner).__module__]
    masks: dict[str, Any] = {}
    for kind in dict.fromkeys(kinds):
        if isinstance(attention_mask, dict):
            # transformers' decoders take such a mapping in place of building their masks.
            masks[kind] = attention_mask[kind]
            continue
        name = _HF_MASK_FUNCTIONS[kind]
        make = getattr(module, name, None)
        if make is None:
            import transformers.masking_utils as masking_utils

            make = getattr(masking_utils, name)
        masks[kind] = make(
            config=inner.config,
            inputs_embeds=h,
            attention_mask=attention_mask,
            cache=None,
            position_ids=position_ids,
        )
    rope = inner.rotary_emb(h, position_ids)
    by_layer = {id(layer): kind for layer, kind in zip(layers, kinds, strict=True)}
    accepted: dict[type, set[str]] = {}

    def run(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        cls = type(layer)
        if cls not in accepted:
            accepted[cls] = set(inspect.signature(cls.forward).parameters)
        names = accepted[cls]
        kwargs: dict[str, Any] = {
            "attention_mask": masks[by_layer[id(layer)]],
            "position_embeddings": rope,
            "position_ids": position_ids,
            "use_cache": False,
        }
        out = layer(x, **{k: v for k, v in kwargs.items() if k in names})
        # transformers 5 layers return the hidden states; older ones a tuple led by them.
        return out[0] if isinstance(out, tuple) else out

    return run


def _generic_cp_runner(model: nn.Module, plan: Any, b: StageBatch) -> LayerRunner:
    """The generic stage's preparation under context parallelism, as the wrapper's CP forward.

    ``GenericCausalLMMixin.forward`` with a CP plan calls ``prepare_generic_cp`` (the local
    tokens' global positions, and one ``GenericCPState`` with the full row's document ids) and
    hands the state to transformers as the keyword ``meshforge_cp``, which its decoder layers pass
    to the attention function unchanged; no attention mask (the plan masks by global positions,
    documents and each call's ``sliding_window``). A stage does the same for its own layers:
    RoPE from the global positions, the state as the layer keyword, and after its last layer
    ``check_generic_cp`` on the attention types of the layers it ran (a stage of only full
    attention layers of a model with sliding ones passes no window, rightly).

    Args:
        model: The pruned wrapped model (its ``meshforge_cp`` holds ``plan``).
        plan: The :class:`~meshforge.parallel.context.ContextParallel` plan.
        b: The stage's batch (its ``ids`` may be a view of the hidden states: the plan reads only
            their shape and device).

    Raises:
        NotImplementedError: A decoder layer that takes no ``**kwargs`` (the state cannot reach
            its attention).
    """
    import inspect

    from meshforge.parallel.context_generic import CP_KWARG, check_generic_cp, prepare_generic_cp

    inner: Any = model.model  # type: ignore[attr-defined]
    index_of = {id(layer): int(key) for key, layer in inner.layers.items()}
    kinds = generic_layer_types(inner, [index_of[id(layer)] for layer in b.layers])
    position_ids, state = prepare_generic_cp(plan, b.ids, b.position_ids, b.segment_ids)
    rope = inner.rotary_emb(b.h, position_ids)
    last = b.layers[-1] if b.layers else None
    accepted: dict[type, set[str]] = {}

    def run(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        cls = type(layer)
        if cls not in accepted:
            params = inspect.signature(cls.forward).parameters
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                raise NotImplementedError(
                    f"not supported yet: parallelism.pipeline_parallel > 1 with context_parallel > 1 for "
                    f"{cls.__name__}: its forward takes no **kwargs, so the context-parallel state "
                    f"({CP_KWARG}) cannot reach its attention"
                )
            accepted[cls] = set(params)
        names = accepted[cls]
        kwargs: dict[str, Any] = {
            "attention_mask": None,
            "position_embeddings": rope,
            "position_ids": position_ids,
            "use_cache": False,
        }
        out = layer(x, **{k: v for k, v in kwargs.items() if k in names}, **{CP_KWARG: state})
        if layer is last:
            # As the wrapper after its forward: the attention calls did reach the CP plan, and
            # with the window of the sliding layers among the ones this stage ran.
            check_generic_cp(model, state, layer_types=kinds)
        return out[0] if isinstance(out, tuple) else out

    return run


def _stage_aux_totals(layers: list[nn.Module], num_experts: int, like: torch.Tensor) -> torch.Tensor | None:
    """``[prob_sum (E), assignments (E), rows]`` summed over the MoE layers just run, or None."""
    stats = [
        layer.mlp.last_aux_stats
        for layer in layers
        if getattr(layer.mlp, "last_aux_stats", None) is not None and getattr(layer, "is_moe", True)
    ]
    if not stats:
        return None
    prob_sum = torch.stack([st.prob_sum for st in stats]).sum(0)
    counts = torch.stack([st.assignments.detach().float() for st in stats]).sum(0)
    rows = torch.stack([st.rows.detach().float() for st in stats]).sum().reshape(1)
    out = torch.cat([prob_sum.float(), counts, rows])
    if out.numel() != 2 * num_experts + 1:
        raise RuntimeError(f"pipeline aux carry: expected {num_experts} experts, got {prob_sum.numel()}")
    return out.to(like.device)


class _PipelinedCausalLM:
    """Mixin placed in front of a pruned model's class: the forward of one local stage."""

    # dict[int, StageInfo]; written with Any because transformers' __init_subclass__ resolves the
    # annotations of every base class at runtime, where StageInfo (pipeline.py) is not importable.
    _pp_stages: dict[int, Any]
    # Set by `Pipeline` when the router aux loss is on: routed experts per layer (carry size).
    _pp_aux_experts: int | None = None
    # Set by the Pipeline for kernels.chunk_loss_size: the last stage returns the normed hidden
    # states and the loss applies lm_head chunk by chunk.
    _pp_return_hidden: bool = False

    def forward(
        self,
        inputs: torch.Tensor,
        carry: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        seq_len: int | None = None,
        *,
        pp_stage: int,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run stage ``pp_stage``: embedding (first) -> its layers -> norm and head (last).

        Args:
            inputs: Token ids ``[B, S]`` on the first stage, hidden states ``[B, S, H]`` after.
            carry: With the router aux loss on, the running aux totals from the previous stage
                (``[2E + 1]``; None on the first stage). See the module docstring.
            position_ids, segment_ids: As ``CausalLM.forward``; every stage rebuilds the mask
                and RoPE tables from them (they are tiny next to one layer's compute).
            seq_len: Tokens per row. Needed after the first stage: under sequence parallelism
                the hidden states passed between stages hold only this rank's part of the row.

        Returns:
            The hidden states (logits on the last stage); with the aux loss on, a pair
            ``(hidden or logits, carry)``.
        """
        stage = self._pp_stages[pp_stage]
        inner: Any = self.model  # type: ignore[attr-defined]
        h = inner.embed_tokens(inputs) if stage.is_first else inputs
        if seq_len is None and stage.is_first:
            seq_len = inputs.shape[-1]
        elif seq_len is None:
            from meshforge.parallel.tensor import sequence_shards

            seq_len = h.shape[1] * sequence_shards(self)  # type: ignore[arg-type]
        layers = [inner.layers[key] for key in stage.layer_keys]
        ids = inputs if stage.is_first else h[..., 0]
        run = self._layer_runner(StageBatch(inner, ids, h, position_ids, segment_ids, seq_len, layers))
        for layer in layers:
            h = run(layer, h)
        if stage.is_last:
            h = inner.norm(h)
            if not self._pp_return_hidden:
                h = self.lm_head(h)  # type: ignore[attr-defined]
        experts = self._pp_aux_experts
        if experts is None:
            return h
        if carry is None:
            # A leaf that requires grad: the stage output always has a graph, even on a first
            # stage without MoE layers (the schedule sends a gradient for every float output).
            carry = torch.zeros(2 * experts + 1, device=h.device, requires_grad=True)
        local = _stage_aux_totals(layers, experts, h)
        return h, (carry + local if local is not None else carry * 1.0)

    # The family's stage preparation (``FamilySpec.stage_preparation``), set by ``pipelined_class``.
    _pp_prepare: Any = None

    def _layer_runner(self, b: StageBatch) -> LayerRunner:
        """The family's stage preparation for this forward's layers."""
        return type(self)._pp_prepare(b)

    def tie_weights(self) -> None:
        """Tie only where this rank holds both ends; otherwise the copies are kept equal by hand."""
        inner: Any = self.model  # type: ignore[attr-defined]
        head = self.lm_head  # type: ignore[attr-defined]
        if inner.embed_tokens is not None and head is not None:
            super().tie_weights()  # type: ignore[misc]

    def num_params(self, **kwargs: Any) -> int:
        """Parameters held by this rank (the pruned model; see ``CausalLM.num_params``)."""
        if kwargs.get("exclude_embedding") and self.model.embed_tokens is None:  # type: ignore[attr-defined]
            kwargs["exclude_embedding"] = False
        return super().num_params(**kwargs)  # type: ignore[misc]


class _PipelinedMoECausalLM(_PipelinedCausalLM):
    """The MoE families' ``moe_layers`` on the pruned ModuleDict (keyed by global index)."""

    def moe_layers(self) -> dict[int, nn.Module]:
        """This rank's sparse blocks by global decoder-layer index."""
        layers: Any = self.model.layers  # type: ignore[attr-defined]
        # gpt-oss layers have no `is_moe`: every one of them is sparse.
        return {int(k): layer.mlp for k, layer in layers.items() if getattr(layer, "is_moe", True)}


class _PipelinedGenericCausalLM(_PipelinedCausalLM):
    """The stage forward in front of a generic transformers model (``GenericCausalLMMixin``)."""

    def _layer_runner(self, b: StageBatch) -> LayerRunner:
        """``_generic_runner``, or under context parallelism (``meshforge_cp``) ``_generic_cp_runner``."""
        hook = getattr(self, "meshforge_cp", None)
        return _generic_runner(b) if hook is None else _generic_cp_runner(self, hook.plan, b)

    def tie_weights(self, *args: Any, **kwargs: Any) -> None:
        """transformers' tying, only where this rank holds both ends (see ``_PipelinedCausalLM``)."""
        inner: Any = self.model  # type: ignore[attr-defined]
        if inner.embed_tokens is not None and self.lm_head is not None:  # type: ignore[attr-defined]
            super(_PipelinedCausalLM, self).tie_weights(*args, **kwargs)  # type: ignore[misc]

    def num_params(self, **kwargs: Any) -> int:
        """Parameters held by this rank (transformers models have no ``num_params`` of their own)."""
        inner: Any = self.model  # type: ignore[attr-defined]
        skip = set()
        if kwargs.get("exclude_embedding") and inner.embed_tokens is not None:
            skip.add(id(inner.embed_tokens.weight))
        params = {id(p): p for p in self.parameters()}  # type: ignore[attr-defined]
        return sum(p.numel() for key, p in params.items() if key not in skip)


_PIPELINED_CLASSES: dict[type, type] = {}


def stage_preparation(cls: type) -> Any:
    """The stage preparation of a model class (its family spec's), or None when PP is not built for it."""
    from meshforge.models.registry import spec_of_model_class
    from meshforge.models.spec import GENERIC

    if getattr(cls, "family", None) == GENERIC:
        return _generic_runner
    spec = spec_of_model_class(cls)
    return None if spec is None else spec.stage_preparation


def pipelined_class(cls: type) -> type:
    """``cls`` with the stage forward in front (cached: one subclass per model class)."""
    if cls not in _PIPELINED_CLASSES:
        from meshforge.models.spec import GENERIC

        body: dict[str, Any] = {}
        if getattr(cls, "family", None) == GENERIC:
            mixin: type = _PipelinedGenericCausalLM
            # As wrap_generic: the class keeps transformers' module (its save code looks there).
            body["__module__"] = cls.__module__
        else:
            mixin = _PipelinedMoECausalLM if hasattr(cls, "moe_layers") else _PipelinedCausalLM
            body["_pp_prepare"] = staticmethod(stage_preparation(cls))
        _PIPELINED_CLASSES[cls] = type(f"Pipelined{cls.__name__}", (mixin, cls), body)
    return _PIPELINED_CLASSES[cls]


class StageModule(nn.Module):
    """One local stage as an ``nn.Module`` for ``PipelineStage``.

    Its forward calls the pruned root model (so FSDP's root hooks gather the embedding, norm
    and head) with ``pp_stage`` set; its registered children are the stage's own modules, so
    ``parameters()`` lists what the stage computes with.
    """

    def __init__(self, model: nn.Module, stage: StageInfo) -> None:
        super().__init__()
        self.stage = stage
        self.__dict__["_root"] = model  # not a child: the root belongs to every local stage
        inner: Any = model.model
        self.layers = nn.ModuleDict({k: inner.layers[k] for k in stage.layer_keys})
        if stage.is_first:
            self.embed_tokens = inner.embed_tokens
        if stage.is_last:
            self.norm = inner.norm
            self.lm_head = model.lm_head

    def forward(
        self,
        inputs: torch.Tensor,
        carry: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        seq_len: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Token ids (first stage) or hidden states in, hidden states (or logits, last stage) out.

        With the router aux loss on, the previous stage's ``carry`` comes in second and the
        output is ``(hidden or logits, carry)``.
        """
        return self.__dict__["_root"](
            inputs, carry, position_ids, segment_ids, seq_len, pp_stage=self.stage.index
        )


def router_aux_experts(model: nn.Module) -> int | None:
    """Routed experts per layer when ``model`` has transformers' router aux loss switched on, else None.

    The aux loss exists for the MoE families whose ``aux_loss`` is ``MoECausalLM``'s (not
    deepseek_v3, which has none) and only with ``output_router_logits``, as without pipelining.
    """
    from meshforge.models.common.causal_lm import MoECausalLM

    if (
        not isinstance(model, MoECausalLM)
        or getattr(type(model), "aux_loss", None) is not MoECausalLM.aux_loss
    ):
        return None
    if not getattr(model.args, "output_router_logits", False):
        return None
    return int(model.num_routed_experts)


__all__ = [
    "GENERIC_MASK_RULES",
    "StageModule",
    "check_generic_layout",
    "generic_layer_types",
    "pipelined_class",
    "router_aux_experts",
    "stage_preparation",
]
