"""Adapter between MiniMax-M2's in-memory parameters and the keys of its safetensors files.

Published MiniMax-M2 checkpoints, and transformers 5.24's ``save_pretrained`` (which reverses its
``minimax_m2`` checkpoint conversion mapping, the Mixtral one), keep the MoE block under its
original name ``block_sparse_moe`` with one key per expert and projection:

==========================================  ====================================================
ours (in memory, transformers' names)       safetensors keys
==========================================  ====================================================
``{p}.mlp.gate.weight``                     ``{p}.block_sparse_moe.gate.weight``
``{p}.mlp.e_score_correction_bias``         ``{p}.block_sparse_moe.e_score_correction_bias``
``{p}.mlp.experts.gate_up_proj`` [E,2I,H]   ``{p}.block_sparse_moe.experts.{e}.w1.weight`` (gate,
                                            rows ``0:I``) and ``...{e}.w3.weight`` (up, ``I:2I``)
``{p}.mlp.experts.down_proj`` [E,H,I]       ``{p}.block_sparse_moe.experts.{e}.w2.weight``
anything else                               the same name
==========================================  ====================================================

``from_hf_config`` reads a published ``config.json`` (``rotary_dim``, top-level ``rope_theta``)
and refuses the variants transformers does not implement (``scoring_func`` other than sigmoid,
no routing bias, shared experts) and FP8 weights by name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from meshforge.models.common.hf_adapter import HFAdapterBase
from meshforge.models.minimax_m2.args import MiniMaxM2Args

if TYPE_CHECKING:
    import torch

    from meshforge.models.spec import FamilySpec, ModelArgs

HF_ARCHITECTURE = "MiniMaxM2ForCausalLM"

_MOE = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.(?P<rest>gate\.weight|e_score_correction_bias)$")
_EXPERTS = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.experts\.(?P<kind>gate_up_proj|down_proj)$")

# config.json keys of MiniMax's own modelling code, with the only value transformers implements.
_FIXED_HF_KEYS: dict[str, object] = {
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
    "shared_intermediate_size": 0,
}


def _expert_keys(layer: str, kind: str, expert: int) -> list[str]:
    base = f"{layer}.block_sparse_moe.experts.{expert}"
    if kind == "gate_up_proj":
        return [f"{base}.w1.weight", f"{base}.w3.weight"]
    return [f"{base}.w2.weight"]


class MiniMaxM2StateDictAdapter(HFAdapterBase):
    """The family's ``HFStateDictAdapter`` (the table of the module docstring).

    Args:
        spec: The family.
        args: The model's args, or None (then the fused expert names cannot list their keys).
    """

    hf_architecture = HF_ARCHITECTURE
    renames_only = False

    def __init__(self, spec: FamilySpec, args: ModelArgs | None = None) -> None:
        super().__init__(spec, args)
        self.num_experts = args.num_local_experts if isinstance(args, MiniMaxM2Args) else None

    def hf_sources(self, name: str) -> list[str]:
        if match := _MOE.match(name):
            return [f"{match['layer']}.block_sparse_moe.{match['rest']}"]
        if match := _EXPERTS.match(name):
            if self.num_experts is None:
                raise ValueError(f"{name}: the per-expert safetensors keys depend on num_local_experts")
            return [
                k for e in range(self.num_experts) for k in _expert_keys(match["layer"], match["kind"], e)
            ]
        return [name]

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch

        keys = self.hf_sources(name)
        missing = [k for k in keys if k not in tensors]
        if missing or len(tensors) != len(keys):
            raise ValueError(f"{name}: expected the keys {keys[:3]}...; missing {missing[:2]}")
        match = _EXPERTS.match(name)
        if match is None:
            return tensors[keys[0]]
        assert self.num_experts is not None  # hf_sources raised otherwise
        layer, kind = match["layer"], match["kind"]
        per_expert = [[tensors[k] for k in _expert_keys(layer, kind, e)] for e in range(self.num_experts)]
        return torch.stack([torch.cat(parts, dim=0) for parts in per_expert])

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if match := _MOE.match(name):
            return {f"{match['layer']}.block_sparse_moe.{match['rest']}": tensor}
        match = _EXPERTS.match(name)
        if match is None:
            return {name: tensor}
        out = {}
        for e in range(tensor.shape[0]):
            keys = _expert_keys(match["layer"], match["kind"], e)
            parts = tensor[e].chunk(2, dim=0) if match["kind"] == "gate_up_proj" else (tensor[e],)
            for key, part in zip(keys, parts, strict=True):
                # Contiguous copies: safetensors refuses tensors that share storage.
                out[key] = part.contiguous().clone()
        return out

    def to_hf_config(self, args: ModelArgs) -> dict[str, object]:
        return {"model_type": "minimax_m2", "architectures": [HF_ARCHITECTURE], **args.to_hf_dict()}

    def from_hf_config(self, config: Mapping[str, object]) -> dict[str, object]:
        return from_hf_config(dict(config))


def from_hf_config(config: dict[str, object]) -> dict[str, object]:
    """``model:`` options from a MiniMax-M2 ``config.json`` (transformers' or MiniMax's own).

    Raises:
        ValueError: For quantised weights or a MiniMax variant transformers does not build.
    """
    from meshforge.models.minimax_m2.args import OPTION_KEYS

    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(
            f"config.json quantization_config: not supported yet: quantized weights ({method}); "
            "convert the checkpoint to bf16/fp32 safetensors first"
        )
    for key, expected in _FIXED_HF_KEYS.items():
        if key in config and config[key] != expected:
            raise ValueError(
                f"config.json {key}: not supported yet: {config[key]!r} (transformers' MiniMax-M2 uses {expected!r})"
            )
    options = {k: v for k, v in config.items() if k in OPTION_KEYS}
    if options.get("rope_parameters") and "rotary_dim" in options:
        options.pop("rotary_dim")  # transformers wrote both; rope_parameters has the factor
    return options


def state_dict_adapter(spec: FamilySpec, args: MiniMaxM2Args | None) -> MiniMaxM2StateDictAdapter:
    """The adapter of ``spec`` with the expert count of ``args`` bound."""
    return MiniMaxM2StateDictAdapter(spec, args)


__all__ = ["HF_ARCHITECTURE", "MiniMaxM2StateDictAdapter", "from_hf_config", "state_dict_adapter"]
