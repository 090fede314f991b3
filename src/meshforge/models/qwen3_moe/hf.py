"""Adapter between Qwen3-MoE's in-memory parameters and the keys transformers writes to safetensors.

transformers 5.24 keeps each layer's experts fused (``mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``) but ``save_pretrained``
writes, and published checkpoints carry, one key per expert and projection:

=====================================  ==============================================
ours (in memory)                       safetensors keys
=====================================  ==============================================
``{p}.mlp.experts.gate_up_proj``       ``{p}.mlp.experts.{e}.gate_proj.weight`` [I, H]
                                       and ``{p}.mlp.experts.{e}.up_proj.weight`` [I, H]
                                       (rows ``0:I`` of expert e are gate, ``I:2I`` up)
``{p}.mlp.experts.down_proj``          ``{p}.mlp.experts.{e}.down_proj.weight`` [H, I]
anything else                          the same name
=====================================  ==============================================

``Qwen3MoeStateDictAdapter`` is the family's ``HFStateDictAdapter`` (what the checkpoint
loader and exporter use). ``from_hf`` and ``to_hf`` find the expert count in their inputs;
``hf_sources`` cannot guess it from a name, so the expert names need ``num_experts`` (bound
from the model's args by the adapter, or by :func:`adapter`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshforge.models.common.hf_adapter import HFAdapterBase

if TYPE_CHECKING:
    import torch

    from meshforge.models.qwen3_moe.args import Qwen3MoeArgs
    from meshforge.models.spec import FamilySpec, ModelArgs

HF_ARCHITECTURE = "Qwen3MoeForCausalLM"

_FUSED = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def _split(name: str) -> tuple[str, str] | None:
    match = _FUSED.match(name)
    return (match["prefix"], match["kind"]) if match else None


def _expert_keys(prefix: str, kind: str, expert: int) -> list[str]:
    if kind == "gate_up_proj":
        return [f"{prefix}.{expert}.gate_proj.weight", f"{prefix}.{expert}.up_proj.weight"]
    return [f"{prefix}.{expert}.down_proj.weight"]


def hf_sources(name: str, num_experts: int | None = None) -> list[str]:
    """Safetensors keys needed to build our parameter ``name``.

    Args:
        name: Our parameter name, e.g. ``model.layers.0.mlp.experts.gate_up_proj``.
        num_experts: Expert count; required for the fused expert parameters.

    Returns:
        ``[name]`` for ordinary parameters; for fused experts the per-expert keys in
        expert order (gate then up for ``gate_up_proj``).

    Raises:
        ValueError: For a fused expert name without ``num_experts``.
    """
    parts = _split(name)
    if parts is None:
        return [name]
    if num_experts is None:
        raise ValueError(
            f"{name}: the per-expert safetensors keys depend on num_experts; call "
            "meshforge.models.qwen3_moe.hf.adapter(args).hf_sources(name) or pass num_experts"
        )
    return [key for e in range(num_experts) for key in _expert_keys(*parts, e)]


def _expert_count(name: str, prefix: str, kind: str, tensors: Mapping[str, object]) -> int:
    """Number of consecutive experts 0.. whose keys are all present; every key must be used."""
    count = 0
    while all(key in tensors for key in _expert_keys(prefix, kind, count)):
        count += 1
    used = {key for e in range(count) for key in _expert_keys(prefix, kind, e)}
    if count == 0 or used != set(tensors):
        missing = [k for k in _expert_keys(prefix, kind, count) if k not in tensors]
        raise ValueError(
            f"{name}: expected per-expert keys {_expert_keys(prefix, kind, 0)} for experts 0..E-1; "
            f"missing {missing[:2]}, unexpected {sorted(set(tensors) - used)[:3]}"
        )
    return count


def from_hf(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Build our parameter ``name`` from the safetensors tensors listed by ``hf_sources``.

    Args:
        name: Our parameter name.
        tensors: Key -> tensor for exactly the keys ``hf_sources(name)`` listed.

    Returns:
        The in-memory tensor (fused ``[E, 2I, H]`` / ``[E, H, I]`` for experts).

    Raises:
        ValueError: When keys are missing or unexpected.
    """
    import torch

    parts = _split(name)
    if parts is None:
        if set(tensors) != {name}:
            raise ValueError(f"{name}: expected exactly the key {name!r}, got {sorted(tensors)[:3]}")
        return tensors[name]
    prefix, kind = parts
    count = _expert_count(name, prefix, kind, tensors)
    if kind == "gate_up_proj":
        return torch.stack(
            [torch.cat([tensors[k] for k in _expert_keys(prefix, kind, e)], dim=0) for e in range(count)]
        )
    return torch.stack([tensors[_expert_keys(prefix, kind, e)[0]] for e in range(count)])


def to_hf(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Safetensors keys and tensors for our parameter ``name`` (``tensor`` is the full parameter).

    Expert slices are returned as contiguous copies: safetensors refuses tensors that
    share storage.

    Args:
        name: Our parameter name.
        tensor: Its full (unsharded) value.

    Returns:
        ``{name: tensor}`` for ordinary parameters; per-expert keys for fused experts.
    """
    parts = _split(name)
    if parts is None:
        return {name: tensor}
    prefix, kind = parts
    out = {}
    for e in range(tensor.shape[0]):
        keys = _expert_keys(prefix, kind, e)
        if kind == "gate_up_proj":
            gate, up = tensor[e].chunk(2, dim=0)
            out[keys[0]] = gate.contiguous().clone()
            out[keys[1]] = up.contiguous().clone()
        else:
            out[keys[0]] = tensor[e].contiguous().clone()
    return out


def to_hf_config(args: Qwen3MoeArgs) -> dict[str, object]:
    """``config.json`` content transformers loads as the same model (model_type, architectures, fields)."""
    return {"model_type": "qwen3_moe", "architectures": [HF_ARCHITECTURE], **args.to_hf_dict()}


@dataclass(frozen=True)
class Qwen3MoeHFAdapter:
    """The protocol functions with the expert count bound from the model's args.

    Attributes:
        num_experts: Routed experts per MoE layer.
    """

    num_experts: int

    def hf_sources(self, name: str) -> list[str]:
        """Like :func:`hf_sources` with this adapter's expert count."""
        return hf_sources(name, self.num_experts)

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Like :func:`from_hf`, also checking the expert count."""
        out = from_hf(name, tensors)
        if _split(name) is not None and out.shape[0] != self.num_experts:
            raise ValueError(f"{name}: checkpoint has {out.shape[0]} experts, the model {self.num_experts}")
        return out

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Same as :func:`to_hf`."""
        return to_hf(name, tensor)


def adapter(args: Qwen3MoeArgs) -> Qwen3MoeHFAdapter:
    """Protocol object (``hf_sources``/``from_hf``/``to_hf`` with plain signatures) for ``args``."""
    return Qwen3MoeHFAdapter(num_experts=args.num_experts)


class Qwen3MoeStateDictAdapter(HFAdapterBase):
    """The family's ``HFStateDictAdapter``: per-expert safetensors keys <-> fused experts.

    Args:
        spec: The family.
        args: The model's args, or None (then fused expert names cannot list their keys).
        num_experts: Routed experts per MoE layer (from ``args``; None without them).
    """

    hf_architecture = HF_ARCHITECTURE
    renames_only = False

    def __init__(
        self, spec: FamilySpec, args: ModelArgs | None = None, *, num_experts: int | None = None
    ) -> None:
        super().__init__(spec, args)
        self.experts = Qwen3MoeHFAdapter(num_experts=num_experts) if num_experts is not None else None

    def hf_sources(self, name: str) -> list[str]:
        return self.experts.hf_sources(name) if self.experts is not None else hf_sources(name)

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.experts.from_hf(name, tensors) if self.experts is not None else from_hf(name, tensors)

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return to_hf(name, tensor)


def state_dict_adapter(spec: FamilySpec, args: Qwen3MoeArgs | None) -> Qwen3MoeStateDictAdapter:
    """The adapter of ``spec`` with the expert count of ``args`` bound."""
    return Qwen3MoeStateDictAdapter(spec, args, num_experts=args.num_experts if args is not None else None)
