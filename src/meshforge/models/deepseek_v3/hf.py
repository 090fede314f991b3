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
from the model's args), ``HF_ARCHITECTURE``, and ``to_hf_config``.
``IGNORED_HF_KEYS`` mirrors transformers' ``_keys_to_ignore_on_load_unexpected``: published
DeepSeek-V3 checkpoints carry the multi-token-prediction module as an extra decoder layer 61
past ``num_hidden_layers`` = 61, which neither transformers nor meshforge builds. Only keys the
model does not need are ever ignored, so a model with a real layer 61 still loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshforge.models.qwen3_moe import hf as _fused
from meshforge.models.qwen3_moe.hf import from_hf, hf_sources, to_hf

if TYPE_CHECKING:
    from meshforge.models.deepseek_v3.args import DeepseekV3Args

HF_ARCHITECTURE = "DeepseekV3ForCausalLM"

IGNORED_HF_KEYS: tuple[str, ...] = ("model.layers.61.*",)


def to_hf_config(args: DeepseekV3Args) -> dict[str, Any]:
    """``config.json`` content transformers loads as the same model (model_type, architectures, fields)."""
    return {"model_type": "deepseek_v3", "architectures": [HF_ARCHITECTURE], **args.to_hf_dict()}


def adapter(args: DeepseekV3Args) -> _fused.Qwen3MoeHFAdapter:
    """Protocol object (``hf_sources``/``from_hf``/``to_hf`` with plain signatures) for ``args``."""
    return _fused.Qwen3MoeHFAdapter(num_experts=args.n_routed_experts)


__all__ = ["HF_ARCHITECTURE", "IGNORED_HF_KEYS", "adapter", "from_hf", "hf_sources", "to_hf", "to_hf_config"]
