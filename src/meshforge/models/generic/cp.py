"""Context parallelism on the transformers path (any ``AutoModelForCausalLM`` meshforge wraps).

Built-in families carry a ``cp`` attribute on their own attention modules; a transformers model's
attention instead calls whatever ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` names
with ``(module, query, key, value, attention_mask, scaling=..., dropout=..., sliding_window=...,
**kwargs)``. So CP plugs in there: :func:`apply_generic_cp` (the spec's ``cp_apply``, called by
``meshforge.parallel.context.apply_cp`` with the plan) registers :func:`cp_attention` as the
attention implementation ``"meshforge_cp"`` and switches the model to it, and the wrapper's forward
(:class:`meshforge.models.generic.model.GenericCausalLMMixin`) builds one :class:`GenericCPState`
per forward (:func:`prepare_generic_cp`: the plan's shared CP mask with the full row's document
ids, and the local tokens' global positions for RoPE) and hands it down as the keyword
``meshforge_cp``: transformers forwards unknown keywords from the causal LM through the decoder
layers to the attention function unchanged, and activation recompute replays them. A pipeline
stage (``stage.py``) runs its decoder layers without that forward, so it does the same itself: ``prepare_generic_cp`` per stage forward, the global positions to the model's
``rotary_emb``, the state as each layer's ``meshforge_cp`` keyword, and ``check_generic_cp`` on the
attention types of the layers it ran.

The attention mask transformers would build is not used: an implementation missing from
``ALL_MASK_ATTENTION_FUNCTIONS`` makes ``create_causal_mask`` return None, and the CP plan masks
by global positions (causal), documents (``segment_ids``) and the layer's ``sliding_window``
(transformers' rule, key j visible from query i when ``i - window < j <= i``) itself, so every
method (ulysses, colossal/ring, kvallgather, hybrid) runs as on the built-in families. Grouped
K/V heads arrive un-repeated, as the plan expects (ulysses repeats them only when their count
does not divide over its ranks).

Refused, with the reason (``NotImplementedError``): attention dropout, attention logit soft-capping,
attention sinks (``s_aux``), non-causal attention, layer types other than full/sliding attention
(linear attention or recurrent layers carry state across the ranks' slices; chunked attention has
no CP mask here), and, found at the first forward, models whose attention does not dispatch
through ``AttentionInterface`` (no call reached :func:`cp_attention`) or whose configured sliding
window reaches no attention call (it would live only in the mask CP replaces).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from meshforge.models.spec import CPPlan

#: The name :func:`cp_attention` is registered under in transformers' ``AttentionInterface``.
ATTN_IMPLEMENTATION = "meshforge_cp"
#: The forward keyword that carries the :class:`GenericCPState` to the attention function.
CP_KWARG = "meshforge_cp"
#: ``config.layer_types`` entries CP can run (anything else is refused).
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class GenericCPState:
    """What one forward's attention calls share: the plan, the mask and a call count.

    Attributes:
        plan: The model's CP plan (``meshforge.parallel.context.ContextParallel``).
        mask: This forward's CP mask object (``CPPlan.prepare``; ``narrow_batch`` slices its rows).
        calls: How many attention calls reached :func:`cp_attention` (checked after the forward).
        windowed: How many of them carried a ``sliding_window``.
        parent: The whole batch's state when this one holds some of its rows (chunked
            micro-batches, ``parallelism.enable_chunk_batch``): calls count there too.
    """

    plan: CPPlan
    mask: Any
    calls: int = 0
    windowed: int = 0
    parent: GenericCPState | None = None

    def record(self, windowed: bool) -> None:
        """Count one attention call here and in the states this one was cut from."""
        state: GenericCPState | None = self
        while state is not None:
            state.calls += 1
            state.windowed += windowed
            state = state.parent

    def narrow_batch(self, dim: int, start: int, stop: int) -> GenericCPState:
        """The state for rows ``start:stop`` (its mask sliced by rows), counting into this one."""
        return GenericCPState(self.plan, self.mask.narrow_batch(dim, start, stop), parent=self)


def _refuse(what: str, why: str) -> NotImplementedError:
    return NotImplementedError(
        f"not supported yet: parallelism.context_parallel > 1 with {what} on the generic transformers "
        f"path: {why}"
    )


def cp_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function ``"meshforge_cp"``: the rank's CP plan on its local tokens.

    Args:
        module: The calling attention module (read for ``head_dim`` when ``scaling`` is None).
        query: This rank's queries ``[B, H, S_local, D]``.
        key: Its keys ``[B, Hkv, S_local, D]`` (grouped heads not repeated).
        value: Its values ``[B, Hkv, S_local, Dv]``.
        attention_mask: Whatever the model built; replaced by the plan's own mask (see module doc).
        scaling: Multiplier of ``q k^T`` (default ``D ** -0.5``).
        dropout: Attention dropout probability; only 0 runs.
        **kwargs: ``meshforge_cp`` (the :class:`GenericCPState`), ``sliding_window``; ``s_aux``,
            ``softcap`` and ``is_causal=False`` are refused; the rest (positions, cache flags) unused.

    Returns:
        ``(output [B, S_local, H, Dv], None)``, the layout transformers' attention functions return.

    Raises:
        NotImplementedError: For dropout, sinks, soft-capping or non-causal attention.
        RuntimeError: When called outside meshforge's forward (no ``meshforge_cp`` state).
    """
    state = kwargs.get(CP_KWARG)
    if not isinstance(state, GenericCPState):
        raise RuntimeError(
            f"{type(module).__name__}: the model's attention implementation is {ATTN_IMPLEMENTATION!r} "
            "(parallelism.context_parallel > 1), which runs only inside meshforge's forward "
            "(model(input_ids, position_ids=..., segment_ids=...)); it holds this rank's slice of the sequence"
        )
    if dropout:
        raise _refuse(f"attention dropout {dropout}", "the CP kernels have no dropout; set it to 0")
    if kwargs.get("s_aux") is not None:
        raise _refuse("attention sinks (s_aux)", "the generic CP attention does not fold sinks in")
    if kwargs.get("softcap") is not None:
        raise _refuse("attention logit soft-capping", "the CP kernels use plain softmax scores")
    if kwargs.get("is_causal") is False:
        raise _refuse("non-causal attention", "CP masks causally by global positions")
    window = kwargs.get("sliding_window")
    if scaling is None:
        scaling = float(getattr(module, "head_dim", query.shape[-1])) ** -0.5
    state.record(bool(window))
    out = state.plan(
        query, key, value, state.mask, scale=float(scaling), window=int(window) if window else None
    )
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Register :func:`cp_attention` in transformers' ``AttentionInterface`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, cp_attention)


def _check_config(config: Any, ulysses_size: int, method: str) -> None:
    """Refuse what the generic CP attention cannot compute exactly, before any forward."""
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    if dropout:
        raise _refuse(
            f"attention_dropout {dropout} (model config)", "the CP kernels have no dropout; set it to 0"
        )
    for name in ("attn_logit_softcapping", "attn_softcapping"):
        if getattr(config, name, None):
            raise _refuse(f"{name} (model config)", "the CP kernels use plain softmax scores")
    if getattr(config, "alibi", False):
        raise _refuse("ALiBi (model config alibi)", "the position bias lives in the mask CP replaces")
    layer_types = getattr(config, "layer_types", None) or ()
    others = sorted({str(t) for t in layer_types} - set(_LAYER_TYPES))
    if others:
        raise _refuse(
            f"layer_types {others} (model config)",
            "only full_attention and sliding_attention layers split over CP ranks (linear or recurrent "
            "layers carry state along the sequence across the ranks' slices; chunked attention has no CP mask)",
        )
    heads = getattr(config, "num_attention_heads", None)
    if heads is not None and int(heads) % ulysses_size:
        raise ValueError(
            f"parallelism.context_parallel: {method} splits the {heads} attention heads over {ulysses_size} "
            f"ranks; num_attention_heads must divide by {ulysses_size}"
        )


def apply_generic_cp(model: nn.Module, plan: CPPlan) -> None:
    """Switch a wrapped transformers model to context-parallel attention, in place.

    Registers ``"meshforge_cp"``, sets it as the model's attention implementation and stores
    a :class:`GenericCPForward` of ``plan`` as ``model.meshforge_cp`` (the wrapper's forward calls
    it, and a pipeline stage's forward reads its plan). Works on the meta device.

    Args:
        model: A model wrapped by :func:`meshforge.models.generic.model.wrap_generic`, whole or split
            into pipeline stages (``meshforge.parallel.pipeline.split_model``).
        plan: The CP plan (built by :func:`meshforge.parallel.context.apply_cp`).

    Raises:
        NotImplementedError: For a model config CP cannot run exactly (see module doc).
        ValueError: When the heads do not divide over the ulysses ranks.
    """
    # wrap_generic wraps transformers models only (pipeline stages keep their class in front).
    hf_model = cast("PreTrainedModel", model)
    config = hf_model.config
    _check_config(config, plan.ulysses_size, plan.method)
    register_attention()
    hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if config._attn_implementation != ATTN_IMPLEMENTATION:
        raise _refuse(
            type(model).__name__,
            "transformers cannot switch its attention implementation (it does not dispatch through "
            "AttentionInterface)",
        )
    # torch types nn.Module.__setattr__'s value Tensor | Module; other values become plain attributes.
    model.meshforge_cp = GenericCPForward(plan)  # type: ignore[assignment]


class GenericCPForward:
    """The ``CPForward`` a wrapped model's forward calls (``model.meshforge_cp``).

    Args:
        plan: The model's CP plan.
    """

    keyword = CP_KWARG

    def __init__(self, plan: CPPlan) -> None:
        self.plan = plan

    def prepare(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, segment_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, GenericCPState]:
        """:func:`prepare_generic_cp` with this plan."""
        return prepare_generic_cp(self.plan, input_ids, position_ids, segment_ids)

    def check(self, model: nn.Module, state: object) -> None:
        """:func:`check_generic_cp` on the whole model."""
        assert isinstance(state, GenericCPState)
        check_generic_cp(model, state)


def prepare_generic_cp(
    plan: CPPlan,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    segment_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, GenericCPState]:
    """One forward's global positions and the state the attention calls share.

    Args:
        plan: The model's CP plan.
        input_ids: This rank's tokens ``[B, S_local]``.
        position_ids: Their global positions (``shard_batch_for_cp`` makes them explicit), or None
            to derive them (restarting per document when ``segment_ids`` are given).
        segment_ids: This rank's slice of the document ids, or None.

    Returns:
        ``(position_ids, state)``; pass ``position_ids`` to the model and ``{CP_KWARG: state}``
        as a forward keyword.
    """
    mask, position_ids = plan.prepare(input_ids, position_ids, segment_ids)
    return position_ids, GenericCPState(plan=plan, mask=mask)


def check_generic_cp(
    model: nn.Module, state: GenericCPState, *, layer_types: Sequence[str] | None = None
) -> None:
    """After a forward: fail where the CP attention cannot have computed the model's attention.

    Args:
        model: The wrapped model (its ``config`` is read).
        state: The forward's state, its attention calls counted.
        layer_types: The attention types (``full_attention``/``sliding_attention``) of the layers
            that ran, when not all of the model's did (a pipeline stage); None: the whole model.

    Raises:
        NotImplementedError: The model computes attention without transformers'
            ``AttentionInterface``, or its config has a sliding window (``config.sliding_window``
            with sliding layers, or without ``layer_types``: Mistral-style, every layer) that no
            attention call was given (the model would apply it only through the mask CP replaces).
    """
    if state.calls == 0:
        raise _refuse(
            type(model).__name__,
            "its attention does not dispatch through transformers' AttentionInterface, so the CP "
            "attention never ran (each rank attended only to its own slice)",
        )
    config = cast("PreTrainedModel", model).config  # a wrapped transformers model, as above
    if layer_types is None:
        layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    window_expected = bool(window) and (layer_types is None or "sliding_attention" in layer_types)
    if window_expected and state.windowed == 0:
        raise _refuse(
            f"config.sliding_window {window} ({type(model).__name__})",
            "its attention calls pass no sliding_window (the window would live only in the mask CP replaces)",
        )


__all__ = [
    "ATTN_IMPLEMENTATION",
    "CP_KWARG",
    "GenericCPForward",
    "GenericCPState",
    "apply_generic_cp",
    "check_generic_cp",
    "cp_attention",
    "prepare_generic_cp",
    "register_attention",
]
