"""Which parameters Muon updates and which AdamW updates (`optimizer.type: Muon`).

Muon orthogonalises the update of a weight matrix that maps one hidden representation to
another; elsewhere it is not defined (vectors) or not what the method was derived for (an
embedding's rows are looked up one at a time, the LM head maps to the vocabulary, a router's
rows are per-expert scores). The rule, as in Moonlight and the Muon references:

* Muon: a 2-D weight (attention and MLP projections), and a 3-D weight of an `experts` module
  (`[E, out, in]`: E matrices, each orthogonalised on its own).
* AdamW: tensors with fewer than 2 dimensions (norms, biases), embeddings (`embed` in the
  name: `embed_tokens`, `wte`), the LM head (`lm_head`, `output`), routers (`*.gate.weight`,
  `router`, `shared_expert_gate`), and any other tensor with more than 2 dimensions (convolutions).

Names are those of `normalize_param_name` (wrapper segments removed). Light module: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshforge.optim.param_groups import normalize_param_name

if TYPE_CHECKING:
    from torch import nn

__all__ = ["MuonSplit", "describe_muon_split", "split_muon"]

_ADAMW_SEGMENTS = ("lm_head", "output", "router", "gate", "shared_expert_gate")


def takes_muon(name: str, ndim: int) -> bool:
    """True when the parameter `name` (normalised) with `ndim` dimensions is a Muon matrix."""
    parts = normalize_param_name(name).split(".")
    modules = parts[:-1]
    if ndim < 2 or any("embed" in p or p == "wte" for p in parts):
        return False
    if any(seg in _ADAMW_SEGMENTS for seg in modules):
        return False
    if ndim == 2:
        return True
    return ndim == 3 and "experts" in modules


@dataclass
class MuonSplit:
    """Parameter names and objects by optimizer, each list in model order."""

    muon: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    adamw: list[tuple[str, nn.Parameter]] = field(default_factory=list)


def split_muon(named_params: Iterable[tuple[str, nn.Parameter]]) -> MuonSplit:
    """Split `(name, parameter)` pairs (trainable, deduplicated) by the rule above.

    Raises:
        ValueError: naming `optimizer.type` when no parameter is a Muon matrix.
    """
    split = MuonSplit()
    seen: set[int] = set()
    for name, param in named_params:
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (split.muon if takes_muon(name, param.dim()) else split.adamw).append((name, param))
    if not split.muon:
        names = ", ".join(normalize_param_name(n) for n, _ in split.adamw[:4]) or "none"
        raise ValueError(
            "optimizer.type: Muon needs 2-D hidden weight matrices (attention/MLP projections, "
            f"expert weights), and this model has none (parameters: {names}); use AdamW"
        )
    return split


def _short(names: list[str], limit: int = 6) -> str:
    # Layer indices folded so that the summary stays one readable line for deep models.
    import re

    folded: list[str] = []
    for name in names:
        generic = re.sub(r"\.\d+\.", ".{*}.", normalize_param_name(name))
        if generic not in folded:
            folded.append(generic)
    more = f", ... ({len(folded) - limit} more)" if len(folded) > limit else ""
    return ", ".join(folded[:limit]) + more


def describe_muon_split(split: MuonSplit) -> str:
    """One log line: tensor and element counts per optimizer, with the names (layers folded)."""
    nm, em = len(split.muon), sum(p.numel() for _, p in split.muon)
    na, ea = len(split.adamw), sum(p.numel() for _, p in split.adamw)
    return (
        f"Muon on {nm} tensors ({em:,} elements: {_short([n for n, _ in split.muon])}); "
        f"AdamW on {na} tensors ({ea:,} elements: {_short([n for n, _ in split.adamw])})"
    )
