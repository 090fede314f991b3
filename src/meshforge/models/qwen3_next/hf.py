"""Adapter between Qwen3-Next's in-memory parameters and the keys transformers writes to safetensors.

The layout is Qwen3-MoE's: transformers 5.24 keeps each sparse layer's routed experts
fused in memory (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj``
``[E, H, I]``) and writes one key per expert and projection
(``mlp.experts.{e}.gate_proj.weight`` ...); everything else, the Gated DeltaNet
parameters (``linear_attn.in_proj_qkvz.weight``, ``A_log``, ``dt_bias``,
``conv1d.weight`` ...), the gated attention and the shared expert, keeps its name and
layout. The expert mapping is therefore the one of :mod:`meshforge.models.qwen3_moe.hf`,
reused here. Published Qwen3-Next checkpoints also carry multi-token-prediction weights
(``mtp.*``) that transformers does not load either; they are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from meshforge.models.qwen3_moe.hf import (
    Qwen3MoeHFAdapter,
    Qwen3MoeStateDictAdapter,
    from_hf,
    hf_sources,
    to_hf,
)

if TYPE_CHECKING:
    from meshforge.models.qwen3_next.args import Qwen3NextArgs
    from meshforge.models.spec import FamilySpec

HF_ARCHITECTURE = "Qwen3NextForCausalLM"

# fnmatch patterns of checkpoint keys the model does not use (transformers'
# `_keys_to_ignore_on_load_unexpected` for Qwen3-Next).
IGNORED_HF_KEYS: tuple[str, ...] = ("mtp.*",)


def from_hf_config(config: dict[str, object]) -> dict[str, object]:
    """``model:`` options from a ``config.json``: the family's keys, ``layer_types`` as an interval.

    transformers writes ``layer_types`` out per layer. When it follows the
    ``full_attention_interval`` rule (full attention on every n-th layer), it is read back as
    that interval, so a ``model: num_hidden_layers`` override keeps the pattern instead of
    leaving a list of the wrong length.
    """
    from meshforge.models.qwen3_next.args import OPTION_KEYS

    options = {k: v for k, v in config.items() if k in OPTION_KEYS}
    kinds = options.get("layer_types")
    if isinstance(kinds, list) and "full_attention" in kinds:
        interval = kinds.index("full_attention") + 1
        pattern = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(len(kinds))]
        if kinds == pattern:
            del options["layer_types"]
            options["full_attention_interval"] = interval
    return options


def to_hf_config(args: Qwen3NextArgs) -> dict[str, object]:
    """``config.json`` content transformers loads as the same model (model_type, architectures, fields)."""
    return {"model_type": "qwen3_next", "architectures": [HF_ARCHITECTURE], **args.to_hf_dict()}


def adapter(args: Qwen3NextArgs) -> Qwen3MoeHFAdapter:
    """Protocol object (``hf_sources``/``from_hf``/``to_hf``) with the expert count of ``args`` bound."""
    return Qwen3MoeHFAdapter(num_experts=args.num_experts)


class Qwen3NextStateDictAdapter(Qwen3MoeStateDictAdapter):
    """The family's ``HFStateDictAdapter``: Qwen3-MoE's expert mapping, ``mtp.*`` ignored."""

    hf_architecture = HF_ARCHITECTURE
    extra_ignored_keys = IGNORED_HF_KEYS

    def from_hf_config(self, config: Mapping[str, object]) -> dict[str, object]:
        return from_hf_config(dict(config))


def state_dict_adapter(spec: FamilySpec, args: Qwen3NextArgs | None) -> Qwen3NextStateDictAdapter:
    """The adapter of ``spec`` with the expert count of ``args`` bound."""
    return Qwen3NextStateDictAdapter(spec, args, num_experts=args.num_experts if args is not None else None)


__all__ = [
    "HF_ARCHITECTURE",
    "IGNORED_HF_KEYS",
    "Qwen3NextStateDictAdapter",
    "adapter",
    "from_hf",
    "from_hf_config",
    "hf_sources",
    "state_dict_adapter",
    "to_hf",
    "to_hf_config",
]
