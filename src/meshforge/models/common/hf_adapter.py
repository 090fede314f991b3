"""The identity HF state-dict adapter, which families subclass where their checkpoints differ.

A family whose parameter names are the safetensors keys transformers writes, one tensor each in
the same layout (qwen3, llama, gpt_oss), uses this class as it is. Families with fused experts
(qwen3_moe, qwen3_next, deepseek_v3) override ``hf_sources`` / ``from_hf`` / ``to_hf`` and set
``renames_only = False`` (the loader then reads whole source tensors instead of each rank's
slice). Light: torch is imported only for type checking.

The adapter reads three names of its family (``AdapterFamily``, which ``FamilySpec`` satisfies)
rather than importing ``models/spec.py``: the spec builds this class as its default adapter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Protocol

from meshforge.models.common.model_args import ModelArgs

if TYPE_CHECKING:
    import torch


class AdapterFamily(Protocol):
    """The names of a family (a ``FamilySpec``) that the adapter's defaults come from."""

    @property
    def name(self) -> str: ...

    @property
    def hf_architectures(self) -> tuple[str, ...]: ...

    @property
    def option_keys(self) -> frozenset[str]: ...


#: Buffers a checkpoint may carry that no model parameter needs.
DEFAULT_IGNORED_KEYS: tuple[str, ...] = ("*.rotary_emb.inv_freq",)


class HFAdapterBase:
    """``HFStateDictAdapter`` with every name mapped to itself.

    Args:
        spec: The family (its name, architectures and option keys fill the defaults).
        args: The model's args when the mapping depends on them (expert counts), else None.
    """

    #: The transformers class written to ``architectures`` (None: the spec's first one).
    hf_architecture: ClassVar[str | None] = None
    #: Checkpoint keys (``fnmatch`` patterns) the family's model does not use.
    extra_ignored_keys: ClassVar[tuple[str, ...]] = ()
    renames_only: ClassVar[bool] = True

    def __init__(self, spec: AdapterFamily, args: ModelArgs | None = None) -> None:
        self.spec = spec
        self.args = args

    @property
    def architecture(self) -> str:
        return self.hf_architecture or self.spec.hf_architectures[0]

    @property
    def ignored_keys(self) -> tuple[str, ...]:
        return self.extra_ignored_keys + DEFAULT_IGNORED_KEYS

    def hf_sources(self, name: str) -> list[str]:
        return [name]

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        (tensor,) = tensors.values()
        return tensor

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: tensor}

    def to_hf_config(self, args: ModelArgs) -> dict[str, object]:
        body = dict(args.to_hf_dict())
        body.setdefault("model_type", self.spec.name)
        body.setdefault("architectures", [self.architecture])
        return body

    def from_hf_config(self, config: Mapping[str, object]) -> dict[str, object]:
        return {k: v for k, v in config.items() if k in self.spec.option_keys}


__all__ = ["DEFAULT_IGNORED_KEYS", "AdapterFamily", "HFAdapterBase"]
