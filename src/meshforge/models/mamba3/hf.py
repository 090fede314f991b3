"""Safetensors names of the Mamba-3 family: the reference checkpoints' ``backbone.*`` keys.

No transformers class exists for Mamba-3, so a folder is written and read by meshforge itself
(``save_hf`` / ``load_hf_weights``); its keys are those of flash-linear-attention's and
transformers' Mamba-2-style ``backbone`` tree (``mamba_ssm``'s own checkpoints name the
embedding ``backbone.embedding`` instead):

    model.embed_tokens.weight  <-> backbone.embeddings.weight
    model.layers.<i>.<rest>    <-> backbone.layers.<i>.<rest>   (norm, mixer.in_proj, ...)
    model.norm.weight          <-> backbone.norm_f.weight
    lm_head.weight             <-> lm_head.weight

Every parameter is one tensor in the same layout (renames only), so ranks read their slices.
``config.json`` carries ``model_type: mamba3``, ``architectures: [Mamba3ForCausalLM]`` (the
class MindSpeed maps ``model_id: mamba3`` to) and the ``Mamba3Args`` fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from meshforge.models.common.hf_adapter import HFAdapterBase

if TYPE_CHECKING:
    import torch

HF_ARCHITECTURE = "Mamba3ForCausalLM"

_RENAMES = (
    ("model.embed_tokens.", "backbone.embeddings."),
    ("model.layers.", "backbone.layers."),
    ("model.norm.", "backbone.norm_f."),
)


def to_hf_name(name: str) -> str:
    """The checkpoint key of parameter ``name``."""
    for ours, theirs in _RENAMES:
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return name


class Mamba3StateDictAdapter(HFAdapterBase):
    """The family's ``HFStateDictAdapter``: the renames above, layouts unchanged."""

    hf_architecture = HF_ARCHITECTURE

    def hf_sources(self, name: str) -> list[str]:
        return [to_hf_name(name)]

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        (tensor,) = tensors.values()
        return tensor

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return {to_hf_name(name): tensor}

    def from_hf_config(self, config: Mapping[str, object]) -> dict[str, object]:
        return {k: v for k, v in config.items() if k in self.spec.option_keys}


__all__ = ["HF_ARCHITECTURE", "Mamba3StateDictAdapter", "to_hf_name"]
