"""The generic Hugging Face path: any local ``AutoModelForCausalLM`` trained through meshforge's loop.

When ``model.model_name_or_path`` names a folder whose config.json is no built-in family,
transformers builds the model (on the meta device, SDPA attention) and meshforge wraps it so the
trainer's contract holds: ``forward(input_ids, position_ids=None, segment_ids=None) -> logits``,
``init_full_parameter_`` (per-parameter, seeded) and ``reset_buffers`` after materialisation.

The wrapper is the transformers model itself with a mixin placed in front of its class (the
instance's class is swapped for a subclass), not a module that holds it: parameter names stay
transformers' in-memory names, so FSDP module patterns such as ``model.layers.{*}`` name the real
tree, ``load_hf_weights`` / ``save_hf`` convert between them and the checkpoint keys with
transformers' own conversion mapping (``models/generic_hf.py``: fused MoE experts), and
transformers' own ``_init_weights`` and ``save_pretrained`` stay available.

``GenericFamily`` is the path's ``FamilySpec`` (name, ``build``, the HF adapter), so the trainer
and the checkpoint code treat it like a built-in family. Its parallel pieces are driven by module
patterns and transformers' own functions instead (``meshforge.parallel``: ``generic_tp_plan``, the
generic stage preparation, ``parallel.context.generic``); parallel code recognises such a model by its
class' ``family`` (``meshforge.models.spec.GENERIC``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshforge.models.generic_hf import GenericHFAdapter
from meshforge.models.spec import GENERIC, CPForward, FamilySpec, HFStateDictAdapter, ModelArgs

# transformers' normalisation modules have family-specific class names (MistralRMSNorm, ...).
_NORM_MARKERS = ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm")


def load_auto_config(hf_dir: Path, *, trust_remote_code: bool) -> Any:
    """``AutoConfig`` of a local folder; transformers' errors re-raised naming the meshforge keys.

    Raises:
        ValueError: transformers cannot read the folder's config (unknown ``model_type``, or
            remote code that needs ``model.trust_remote_code: true``).
    """
    from transformers import AutoConfig

    kwargs = {"trust_remote_code": True} if trust_remote_code else {}
    try:
        return AutoConfig.from_pretrained(str(hf_dir), local_files_only=True, **kwargs)
    except (ValueError, KeyError, OSError) as err:
        hint = (
            "; the folder ships its own modelling code: set model.trust_remote_code: true if you trust it"
            if not trust_remote_code and "trust_remote_code" in str(err)
            else ""
        )
        raise ValueError(
            f"model.model_name_or_path: transformers cannot build {hf_dir} through the generic "
            f"transformers path ({type(err).__name__}: {str(err).strip().splitlines()[0]}){hint}"
        ) from None


@dataclass(frozen=True)
class GenericFamily(FamilySpec):
    """A ``FamilySpec`` for a transformers model meshforge does not build itself.

    Attributes:
        hf_dir: The local folder with config.json.
        trust_remote_code: Passed to transformers only when True (``model.trust_remote_code``).
    """

    hf_dir: Path = field(default=Path("."))
    trust_remote_code: bool = False

    def parse_options(self, options: dict[str, object]) -> Any:
        """The folder's ``AutoConfig`` with ``options`` (passthrough ``model:`` keys) set on it."""
        config = load_auto_config(self.hf_dir, trust_remote_code=self.trust_remote_code)
        for key, value in options.items():
            setattr(config, key, value)
        return config

    def build(self, options: dict[str, object], *, device: str | torch.device = "meta") -> nn.Module:
        """Build the transformers model (SDPA attention) on ``device`` and wrap it in place."""
        from transformers import AutoModelForCausalLM

        config = self.parse_options(options)
        kwargs = {"trust_remote_code": True} if self.trust_remote_code else {}
        try:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", **kwargs)
        except (ValueError, KeyError, ImportError) as err:
            raise ValueError(
                f"model.model_name_or_path: transformers cannot build a causal LM with SDPA attention from "
                f"{self.hf_dir} ({type(err).__name__}: {str(err).strip().splitlines()[0]})"
            ) from None
        return wrap_generic(model)


def _refuse_options(options: dict[str, object]) -> ModelArgs:
    raise TypeError("GenericFamily.parse_options reads the folder's config; call it on the family")


def _refuse_build(args: ModelArgs, device: str | torch.device) -> nn.Module:
    raise TypeError("GenericFamily.build builds from the folder; call it on the family")


def _generic_adapter(spec: FamilySpec, args: ModelArgs | None) -> HFStateDictAdapter:
    return GenericHFAdapter(spec, args)


def generic_family(hf_dir: Path, hf_config: dict[str, Any], *, trust_remote_code: bool) -> GenericFamily:
    """The ``GenericFamily`` for a folder whose config.json (``hf_config``) names no built family."""
    architectures = hf_config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    return GenericFamily(
        name=str(hf_config.get("model_type") or "generic"),
        hf_architectures=tuple(architectures),
        model_ids=(),
        option_keys=frozenset(),
        from_options=_refuse_options,
        builder=_refuse_build,
        adapter=_generic_adapter,
        hf_dir=Path(hf_dir),
        trust_remote_code=trust_remote_code,
    )


class GenericCausalLMMixin:
    """Placed in front of a transformers ``*ForCausalLM`` class: meshforge's model contract."""

    family = GENERIC

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
        plan: CPForward | None = getattr(self, "meshforge_cp", None)
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
