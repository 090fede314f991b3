"""Adapter between Step-3.5's in-memory parameters and the keys of its published safetensors.

The published checkpoint (stepfun-ai/Step-3.5-Flash, the keys its ``modeling_step3p5.py`` module
tree gives) keeps each sparse layer's routed experts as three 3-D tensors; meshforge fuses gate
and up for the grouped expert compute and expert parallelism:

==========================================  ===================================================
ours (in memory)                            published safetensors keys
==========================================  ===================================================
``{p}.moe.experts.gate_up_proj`` [E,2I,H]   ``{p}.moe.gate_proj.weight`` [E,I,H] (rows ``0:I``)
                                            and ``{p}.moe.up_proj.weight`` [E,I,H] (``I:2I``)
``{p}.moe.experts.down_proj`` [E,H,I]       ``{p}.moe.down_proj.weight`` [E,H,I]
anything else                               the same name
==========================================  ===================================================

The published file also carries the ``num_nextn_predict_layers`` MTP layers as decoder layers
past ``num_hidden_layers`` (``model.layers.45-47`` for the 45-layer model); the published
modelling code ignores them on load, and so does this adapter.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from meshforge.models.common.hf_adapter import HFAdapterBase
from meshforge.models.step3p5.args import OPTION_KEYS, Step3p5Args

if TYPE_CHECKING:
    import torch

    from meshforge.models.spec import FamilySpec, ModelArgs

HF_ARCHITECTURE = "Step3p5ForCausalLM"

_EXPERTS = re.compile(r"^(?P<layer>model\.layers\.\d+)\.moe\.experts\.(?P<kind>gate_up_proj|down_proj)$")


def _keys(layer: str, kind: str) -> list[str]:
    if kind == "gate_up_proj":
        return [f"{layer}.moe.gate_proj.weight", f"{layer}.moe.up_proj.weight"]
    return [f"{layer}.moe.down_proj.weight"]


class Step3p5StateDictAdapter(HFAdapterBase):
    """The family's ``HFStateDictAdapter`` (the table of the module docstring)."""

    hf_architecture = HF_ARCHITECTURE
    renames_only = False

    @property
    def ignored_keys(self) -> tuple[str, ...]:
        extra: tuple[str, ...] = ()
        if isinstance(self.args, Step3p5Args):
            first = self.args.num_hidden_layers
            extra = tuple(f"model.layers.{first + i}.*" for i in range(self.args.num_nextn_predict_layers))
        return extra + super().ignored_keys

    def hf_sources(self, name: str) -> list[str]:
        match = _EXPERTS.match(name)
        return _keys(match["layer"], match["kind"]) if match else [name]

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch

        keys = self.hf_sources(name)
        if sorted(tensors) != sorted(keys):
            raise ValueError(f"{name}: expected the keys {keys}, got {sorted(tensors)[:3]}")
        if len(keys) == 2:
            return torch.cat([tensors[keys[0]], tensors[keys[1]]], dim=1)
        return tensors[keys[0]]

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        keys = self.hf_sources(name)
        if len(keys) == 2:
            gate, up = tensor.chunk(2, dim=1)
            # Contiguous copies: safetensors refuses tensors that share storage.
            return {keys[0]: gate.contiguous().clone(), keys[1]: up.contiguous().clone()}
        return {keys[0]: tensor}

    def to_hf_config(self, args: ModelArgs) -> dict[str, object]:
        return {"model_type": "step3p5", "architectures": [HF_ARCHITECTURE], **args.to_hf_dict()}

    def from_hf_config(self, config: Mapping[str, object]) -> dict[str, object]:
        return from_hf_config(dict(config))


def from_hf_config(config: dict[str, object]) -> dict[str, object]:
    """``model:`` options from a published Step-3.5 ``config.json`` (the text model's part).

    A multimodal wrapper's ``text_config`` is read when present. Keys the published modelling
    code does not read (``max_seq_len``, ``moe_every_n_layer``, ...) are dropped.

    Raises:
        ValueError: For quantised weights.
    """
    text = config.get("text_config")
    body = dict(text) if isinstance(text, dict) else config
    quant = config.get("quantization_config") or body.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(
            f"config.json quantization_config: not supported yet: quantized weights ({method}); "
            "convert the checkpoint to bf16/fp32 safetensors first"
        )
    return {k: v for k, v in body.items() if k in OPTION_KEYS and k != "flavor"}


def state_dict_adapter(spec: FamilySpec, args: Step3p5Args | None) -> Step3p5StateDictAdapter:
    """The adapter of ``spec`` bound to ``args`` (the MTP layers it ignores)."""
    return Step3p5StateDictAdapter(spec, args)


__all__ = ["HF_ARCHITECTURE", "Step3p5StateDictAdapter", "from_hf_config", "state_dict_adapter"]
