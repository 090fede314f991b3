"""The transformers path's model: any local ``AutoModelForCausalLM`` trained through meshforge's loop.

When ``model.model_name_or_path`` names a folder whose config.json is no built-in family,
transformers builds the model (on the meta device, SDPA attention) and meshforge wraps it so the
trainer's contract holds: ``forward(input_ids, position_ids=None, segment_ids=None) -> logits``,
``init_full_parameter_`` (per-parameter, seeded), ``reset_buffers`` after materialisation and
``num_params``.

The wrapper is the transformers model itself with a mixin placed in front of its class (the
instance's class is swapped for a subclass), not a module that holds it: parameter names stay
transformers' in-memory names, so FSDP module patterns such as ``model.layers.{*}`` name the real
tree, ``load_hf_weights`` / ``save_hf`` convert between them and the checkpoint keys with
transformers' own conversion mapping (``hf.py``: fused MoE experts), and transformers' own
``_init_weights`` and ``save_pretrained`` stay available.

The path's ``FamilySpec`` is ``spec.py`` (``GenericFamily``); the class' ``family``
(``meshforge.models.spec.GENERIC``) is how the registry finds it for a wrapped model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshforge.models.spec import GENERIC, CPForward

# transformers' normalisation modules have family-specific class names (MistralRMSNorm, ...).
_NORM_MARKERS = ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm")


def build_generic(
    config: Any, device: str | torch.device, *, hf_dir: Path, trust_remote_code: bool
) -> nn.Module:
    """transformers' causal LM of ``config`` (SDPA attention) on ``device``, wrapped in place.

    Raises:
        ValueError: transformers cannot build it (naming ``model.model_name_or_path``), or the
            model cannot take a 4-D attention mask (``wrap_generic``).
    """
    from transformers import AutoModelForCausalLM

    kwargs = {"trust_remote_code": True} if trust_remote_code else {}
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", **kwargs)
    except (ValueError, KeyError, ImportError) as err:
        raise ValueError(
            f"model.model_name_or_path: transformers cannot build a causal LM with SDPA attention from "
            f"{hf_dir} ({type(err).__name__}: {str(err).strip().splitlines()[0]})"
        ) from None
    return wrap_generic(model)


class GenericCausalLMMixin:
    """Placed in front of a transformers ``*ForCausalLM`` class: meshforge's model contract."""

    family = GENERIC
    # Set by ``cp.apply_generic_cp`` (context parallelism); None without CP.
    meshforge_cp: CPForward | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Logits ``[B, S, vocab]``; ``segment_ids`` give a block-diagonal causal mask (packed documents)."""
        if kwargs:
            # transformers' own calling convention (labels=, attention_mask=, ...): its forward.
            return super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)  # type: ignore[misc]
        plan = self.meshforge_cp
        if plan is not None:
            # Context parallel (set by apply_cp): this rank holds a slice of each row; the CP
            # attention builds its own mask and RoPE reads the tokens' global positions.
            position_ids, state = plan.prepare(input_ids, position_ids, segment_ids)
            out = super().forward(  # type: ignore[misc]
                input_ids=input_ids, position_ids=position_ids, use_cache=False, **{plan.keyword: state}
            )
            plan.check(self, state)  # type: ignore[arg-type]
            return out.logits
        mask = None
        if segment_ids is not None:
            from meshforge.models.common.attention import positions_from_segments

            mask = packed_masks(self.config, segment_ids)  # type: ignore[attr-defined]
            if position_ids is None:
                # Positions restart per document, as in the built-in families (and under CP).
                position_ids = positions_from_segments(segment_ids)
        out = super().forward(  # type: ignore[misc]
            input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False
        )
        return out.logits

    def init_full_parameter_(self, fqn: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """HF-style init of one full parameter: normal(0, initializer_range), norms ones, biases zeros."""
        owner_name, _, leaf = fqn.rpartition(".")
        owner = self.get_submodule(owner_name) if owner_name else self  # type: ignore[attr-defined]
        kind = type(owner).__name__
        if leaf == "bias":
            tensor.zero_()
        elif any(marker in kind for marker in _NORM_MARKERS):
            tensor.fill_(1.0)
        else:
            config = self.config  # type: ignore[attr-defined]
            std = getattr(config, "initializer_range", None) or getattr(config, "init_std", None) or 0.02
            tensor.normal_(0.0, float(std), generator=generator)
            padding = getattr(owner, "padding_idx", None)
            if isinstance(owner, nn.Embedding) and padding is not None:
                tensor[padding].zero_()

    def num_params(self, *, exclude_embedding: bool = False, active: bool = False) -> int:
        """Parameters (a tied one once), without the input embedding's when ``exclude_embedding``.

        transformers models have no such method; a pipeline stage (embedding on the first stage
        only) counts what this rank holds. ``active`` counts them all (the routing of a
        transformers MoE is not known here).
        """
        inner: Any = getattr(self, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        skip = set()
        if exclude_embedding and embed is not None:
            skip.add(id(embed.weight))
        params = {id(p): p for p in self.parameters()}  # type: ignore[attr-defined]
        return sum(p.numel() for key, p in params.items() if key not in skip)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute buffers (rotary ``inv_freq``, ...) left empty by building on the meta device."""
        for module in self.modules():  # type: ignore[attr-defined]
            has_buffers = any(True for _ in module.buffers(recurse=False))
            if has_buffers and not any(True for _ in module.parameters(recurse=False)):
                # transformers' own init knows each buffer (rotary frequencies, causal-mask tables).
                self._init_weights(module)  # type: ignore[attr-defined]


def packed_masks(config: Any, segment_ids: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """The block-diagonal causal mask(s) of packed rows, with the model's sliding window where it has one.

    A 4-D mask reaches the attention as it is (transformers' "prepared mask"), so transformers no
    longer adds its sliding window: it is added here. Models with ``config.layer_types`` get one
    mask per layer type (the mapping transformers' decoders accept in place of building theirs);
    the others (Mistral-style) apply ``config.sliding_window``, when set, to every layer.

    Args:
        config: The transformers config (``sliding_window``, ``layer_types`` read).
        segment_ids: ``[B, S]`` document ids (0 = padding).

    Returns:
        A boolean ``[B, 1, S, S]`` mask, or ``{layer_type: mask}``.
    """
    from meshforge.models.common.attention import segment_causal_mask

    mask = segment_causal_mask(segment_ids)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return mask
    index = torch.arange(segment_ids.shape[-1], device=segment_ids.device)
    # transformers' rule: key j visible from query i when i - window < j (<= i, the causal part).
    windowed = mask & (index[None, :] > index[:, None] - int(window))
    if layer_types is None:
        return windowed
    return {kind: windowed if kind == "sliding_attention" else mask for kind in set(layer_types)}


_WRAPPED: dict[type, type] = {}


def wrap_generic(model: nn.Module) -> nn.Module:
    """Give a transformers causal LM meshforge's forward/init contract, in place (names unchanged).

    Raises:
        ValueError: When the model cannot take a 4-D attention mask (no ``attention_mask`` or an
            attention implementation other than SDPA/eager).
    """
    import inspect

    cls = type(model)
    if "attention_mask" not in inspect.signature(cls.forward).parameters:
        raise ValueError(
            f"model.model_name_or_path: {cls.__name__} takes no attention_mask, so packed documents "
            "(segment_ids) cannot be kept apart; the generic transformers path cannot train it"
        )
    impl = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
    if impl not in ("sdpa", "eager"):
        raise ValueError(
            f"model.model_name_or_path: {cls.__name__} uses {impl!r} attention, which takes no 4-D "
            "block-diagonal mask; the generic path needs sdpa or eager"
        )
    if cls not in _WRAPPED:
        _WRAPPED[cls] = type(cls.__name__, (GenericCausalLMMixin, cls), {"__module__": cls.__module__})
    model.__class__ = _WRAPPED[cls]
    return model
