"""Adapter between DeepSeek-V3's in-memory parameters and the keys transformers writes to safetensors.

The layout question is the one Qwen3-MoE has, with the same names: transformers 5.24 keeps
each sparse layer's routed experts fused (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
``mlp.experts.down_proj`` ``[E, H, I]``) but writes one key per expert and projection
(``mlp.experts.{e}.gate_proj.weight`` ...). The mapping is therefore the one of
:mod:`meshforge.models.qwen3_moe.hf`, reused here rather than repeated. Everything else,
including ``mlp.shared_experts.*`` and ``mlp.gate.e_score_correction_bias`` (a buffer in
transformers, a frozen parameter here; the same safetensors key either way), keeps its name.

Protocol used by the checkpoint loader/exporter (see :mod:`meshforge.checkpoint.hf`):
``hf_sources``, ``from_hf``, ``to_hf`` through :func:`adapter` (which binds the expert count
from the model's args), ``HF_ARCHITECTURE``, ``to_hf_config`` and ``from_hf_config``.
``IGNORED_HF_KEYS`` mirrors transformers' ``_keys_to_ignore_on_load_unexpected``: published
DeepSeek-V3 checkpoints carry the multi-token-prediction module as an extra decoder layer 61
past ``num_hidden_layers`` = 61, which transformers does not build; meshforge builds it
(``num_nextn_predict_layers``, ``mtp.py``) under the same names, and ignores it otherwise.
Only keys the model does not need are ever ignored, so a model with a real layer 61 still
loads it. Each MTP block's copies of the embedding and head (``embed_tokens``,
``shared_head.head``) are ignored on load (the model shares its own) and written on export.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

from meshforge.models.qwen3_moe import hf as _fused
from meshforge.models.qwen3_moe.hf import Qwen3MoeStateDictAdapter, from_hf, hf_sources, to_hf

if TYPE_CHECKING:
    import torch

    from meshforge.models.deepseek_v3.args import DeepseekV3Args
    from meshforge.models.spec import FamilySpec

HF_ARCHITECTURE = "DeepseekV3ForCausalLM"

IGNORED_HF_KEYS: tuple[str, ...] = (
    "model.layers.61.*",
    # Each published MTP block carries copies of the embedding and the head; ours shares them.
    "model.layers.*.embed_tokens.weight",
    "model.layers.*.shared_head.head.weight",
)


# config.json keys of DeepSeek's own modelling code (transformers < 4.50 era files) that
# transformers' port does not read: the values its port hard-codes are the only ones accepted,
# so a checkpoint that needs something else is refused instead of silently changed.
_FIXED_HF_KEYS: dict[str, object] = {
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "moe_layer_freq": 1,
}


def from_hf_config(config: dict[str, object]) -> dict[str, object]:
    """``model:`` options from a DeepSeek-V3 ``config.json`` (transformers' or DeepSeek's own).

    Keys that are family options pass through; a legacy ``rope_scaling`` becomes
    ``rope_parameters`` (with ``rope_theta``; ``type`` read as ``rope_type``), which the args
    check (``default`` and ``yarn`` are built, others refused by name). Other keys
    (``transformers_version``, ``auto_map``, ``aux_loss_alpha``, ...) are dropped.

    Raises:
        ValueError: For a ``quantization_config`` format the loader does not dequantise (the
            published block-wise FP8 is), or a routing variant other than the one transformers
            implements (``scoring_func``, ``topk_method``, ``moe_layer_freq``).
    """
    from meshforge.models.common.dequant import quantization_method
    from meshforge.models.deepseek_v3.args import OPTION_KEYS

    # The published FP8 weights are dequantised at load (models/common/dequant.py); other formats fail here.
    quantization_method(config)
    for key, expected in _FIXED_HF_KEYS.items():
        if key in config and config[key] != expected:
            raise ValueError(
                f"config.json {key}: not supported yet: {config[key]!r} (transformers' DeepSeek-V3 uses {expected!r})"
            )
    options = {k: v for k, v in config.items() if k in OPTION_KEYS}
    scaling = config.get("rope_scaling")
    if scaling and not options.get("rope_parameters"):
        if not isinstance(scaling, Mapping):
            raise ValueError(f"config.json rope_scaling: must be a mapping, got {scaling!r}")
        rope = dict(scaling)
        rope.setdefault("rope_type", rope.pop("type", "default"))
        if config.get("rope_theta") is not None:
            rope.setdefault("rope_theta", config["rope_theta"])
        options["rope_parameters"] = rope
    return options


def mtp_fit(options: dict[str, object], keys: set[str]) -> dict[str, tuple[object, str]]:
    """``{"num_nextn_predict_layers": (0, why)}`` when config.json asks for MTP blocks the weights lack.

    transformers builds no MTP block and its ``save_pretrained`` writes none, yet keeps the
    config field (default 1); DeepSeek's published folders store the block as layer
    ``num_hidden_layers``.
    """
    from meshforge.models.deepseek_v3.args import from_options

    args = from_options(options)
    if not args.num_nextn_predict_layers:
        return {}
    prefix = f"model.layers.{args.num_hidden_layers}."
    if any(key.startswith(prefix) for key in keys):
        return {}
    return {
        "num_nextn_predict_layers": (
            0,
            f"the weights hold no multi-token-prediction block ({prefix}*; transformers does not save one)",
        )
    }


def to_hf_config(args: DeepseekV3Args) -> dict[str, object]:
    """``config.json`` content transformers loads as the same model (model_type, architectures, fields)."""
    return {"model_type": "deepseek_v3", "architectures": [HF_ARCHITECTURE], **args.to_hf_dict()}


def adapter(args: DeepseekV3Args) -> _fused.Qwen3MoeHFAdapter:
    """Protocol object (``hf_sources``/``from_hf``/``to_hf`` with plain signatures) for ``args``."""
    return _fused.Qwen3MoeHFAdapter(num_experts=args.n_routed_experts)


class DeepseekV3StateDictAdapter(Qwen3MoeStateDictAdapter):
    """The family's ``HFStateDictAdapter``: Qwen3-MoE's expert mapping, DeepSeek's config.json."""

    hf_architecture = HF_ARCHITECTURE
    extra_ignored_keys = IGNORED_HF_KEYS

    def from_hf_config(self, config: Mapping[str, object]) -> dict[str, object]:
        return from_hf_config(dict(config))

    def fit_to_weights(self, options: dict[str, object], keys: set[str]) -> dict[str, tuple[object, str]]:
        """Options to change for a folder whose weights hold no MTP block (``fit_to_weights`` hook)."""
        return mtp_fit(options, keys)

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-expert keys, plus the published per-MTP-block copies of the embedding and head."""
        out = to_hf(name, tensor)
        args = cast("DeepseekV3Args | None", self.args)
        if args is None or not args.num_nextn_predict_layers:
            return out
        copies = []
        if name == "model.embed_tokens.weight":
            copies.append("embed_tokens.weight")
            if args.tie_word_embeddings:
                copies.append("shared_head.head.weight")
        elif name == "lm_head.weight":
            copies.append("shared_head.head.weight")
        for d in range(args.num_nextn_predict_layers):
            for key in copies:
                # safetensors refuses tensors sharing storage: each copy is its own.
                out[f"model.layers.{args.num_hidden_layers + d}.{key}"] = tensor.clone()
        return out


def state_dict_adapter(spec: FamilySpec, args: DeepseekV3Args | None) -> DeepseekV3StateDictAdapter:
    """The adapter of ``spec`` with the routed-expert count of ``args`` bound."""
    return DeepseekV3StateDictAdapter(
        spec, args, num_experts=args.n_routed_experts if args is not None else None
    )


__all__ = [
    "HF_ARCHITECTURE",
    "mtp_fit",
    "IGNORED_HF_KEYS",
    "DeepseekV3StateDictAdapter",
    "adapter",
    "from_hf",
    "from_hf_config",
    "hf_sources",
    "state_dict_adapter",
    "to_hf",
    "to_hf_config",
]
