"""The pipeline stage of the transformers path: the spec's ``stage_check`` and ``stage_preparation``.

A stage reproduces what the wrapper's forward (``model.py``) builds for its layers: the masks
transformers' own mask functions build for each layer's attention type, the RoPE tables of the
model's ``rotary_emb`` and the positions, for the model types in ``GENERIC_MASK_RULES``
(``check_generic_layout`` refuses the rest by name). Under context parallelism (the model's
``meshforge_cp``, see ``cp.py``) no mask, RoPE from the global positions and the per-forward CP
state as each layer's keyword, as the wrapper's CP forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from meshforge.models.common.attention import positions_from_segments
from meshforge.models.common.stage import LayerRunner, StageBatch
from meshforge.models.generic.cp import CP_KWARG, check_generic_cp, prepare_generic_cp
from meshforge.models.generic.model import packed_masks

if TYPE_CHECKING:
    from meshforge.models.spec import CPPlan

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
        layer_kind: str | None = types[i] if i < len(types) else None
        if layer_kind is None or layer_kind not in _HF_MASK_FUNCTIONS:
            raise NotImplementedError(
                f"not supported yet: parallelism.pipeline_parallel > 1 for {type(inner).__name__} layer {i} "
                f"of type {layer_kind!r} (config.layer_types); stages build full_attention and sliding_attention masks"
            )
        out.append(layer_kind)
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


def generic_stage(b: StageBatch) -> LayerRunner:
    """A transformers ``*Model.forward``'s preparation, as ``GenericCausalLMMixin.forward`` calls it.

    The one-process generic forward passes ``segment_ids`` as the block-diagonal causal mask(s) of
    ``meshforge.models.generic.model.packed_masks`` (``attention_mask``; sliding windows included) and, when no ``position_ids`` are given, positions that restart at every
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
        # As the wrapper: the block-diagonal mask with the model's sliding window added (a 4-D
        # mask reaches the attention as it is), one per layer type when the model has them.
        attention_mask = packed_masks(inner.config, segment_ids)
        if position_ids is None:
            # As the wrapper (and the built-in families): positions restart per document.
            position_ids = positions_from_segments(segment_ids)
    if position_ids is None:
        position_ids = torch.arange(b.seq_len, device=h.device).unsqueeze(0)
    module = sys.modules[type(inner).__module__]
    masks: dict[str, object] = {}
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
        kwargs: dict[str, object] = {
            "attention_mask": masks[by_layer[id(layer)]],
            "position_embeddings": rope,
            "position_ids": position_ids,
            "use_cache": False,
        }
        out = layer(x, **{k: v for k, v in kwargs.items() if k in names})
        # transformers 5 layers return the hidden states; older ones a tuple led by them.
        return out[0] if isinstance(out, tuple) else out

    return run


def generic_cp_stage(model: nn.Module, plan: CPPlan, b: StageBatch) -> LayerRunner:
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
        plan: The model's CP plan (``CPPlan``).
        b: The stage's batch (its ``ids`` may be a view of the hidden states: the plan reads only
            their shape and device).

    Raises:
        NotImplementedError: A decoder layer that takes no ``**kwargs`` (the state cannot reach
            its attention).
    """
    import inspect

    inner: Any = model.model
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
        kwargs: dict[str, object] = {
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


def stage_preparation(b: StageBatch) -> LayerRunner:
    """The spec's ``stage_preparation``: :func:`generic_stage`, or with a CP plan on the pruned
    model ``b.model`` (``meshforge_cp``, set by ``cp.apply_generic_cp``) :func:`generic_cp_stage`."""
    hook = getattr(b.model, "meshforge_cp", None)
    return generic_stage(b) if hook is None else generic_cp_stage(b.model, hook.plan, b)


__all__ = [
    "GENERIC_MASK_RULES",
    "check_generic_layout",
    "generic_cp_stage",
    "generic_layer_types",
    "generic_stage",
    "stage_preparation",
]
