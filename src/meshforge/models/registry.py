"""Model-family registry: which built-in family a config names, and its option keys.

A family is found by any of the three names a config may carry: transformers'
``model_type`` (``qwen3``), an ``architectures`` entry (``Qwen3ForCausalLM``, a
string or a list as in ``config.json``) or MindSpeed's ``model_id``. The registry
is light (no torch at import; the config system uses it to check ``model:``
passthrough keys); ``FamilySpec.build`` imports the family's modules on first use.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class FamilySpec:
    """A built-in model family.

    Attributes:
        name: Family name, equal to its transformers ``model_type``.
        hf_architectures: transformers class names it stands for.
        model_ids: MindSpeed ``model_id`` values that select it.
        option_keys: ``model:`` passthrough keys the family declares (its args fields
            plus ``flavor``).
        args_module: Module holding ``from_options`` and ``FLAVORS``.
        model_module: Module holding ``build_<name>``.
        hf_module: Optional module with the family's Hugging Face adapter (key and layout
            mapping, config.json conversion; protocol in ``meshforge.checkpoint.hf``).
            None means the parameter names are the HF safetensors keys as they are.
    """

    name: str
    hf_architectures: tuple[str, ...]
    model_ids: tuple[str, ...]
    option_keys: frozenset[str]
    args_module: str
    model_module: str
    hf_module: str | None = None

    def parse_options(self, options: dict[str, Any]) -> Any:
        """Validate ``options`` into the family's args dataclass (imports no torch)."""
        return importlib.import_module(self.args_module).from_options(options)

    def build(self, options: dict[str, Any], *, device: str | torch.device = "meta") -> nn.Module:
        """Construct the model from passthrough options, on the meta device by default.

        Raises:
            ValueError: For an unknown or invalid option.
        """
        args = self.parse_options(options)
        builder: Callable[..., nn.Module] = getattr(
            importlib.import_module(self.model_module), f"build_{self.name}"
        )
        return builder(args, device=device)


def _qwen3_option_keys() -> frozenset[str]:
    from meshforge.models.qwen3.args import OPTION_KEYS

    return OPTION_KEYS


_FAMILIES: dict[str, FamilySpec] = {
    "qwen3": FamilySpec(
        name="qwen3",
        hf_architectures=("Qwen3ForCausalLM",),
        model_ids=("qwen3",),
        option_keys=_qwen3_option_keys(),
        args_module="meshforge.models.qwen3.args",
        model_module="meshforge.models.qwen3.model",
    ),
}


# Families that keep their entry beside their code (`models/<family>/spec.py`). Loaded on first
# use, not at import: each spec module imports `FamilySpec` from here (a cycle otherwise).
_SPEC_MODULES = (
    "meshforge.models.llama.spec",
    "meshforge.models.qwen3_moe.spec",
    "meshforge.models.deepseek_v3.spec",
    "meshforge.models.gpt_oss.spec",
    "meshforge.models.qwen3_next.spec",
)


def _families() -> dict[str, FamilySpec]:
    for module_name in _SPEC_MODULES:
        family = importlib.import_module(module_name).FAMILY
        _FAMILIES.setdefault(family.name, family)
    return _FAMILIES


def built_families() -> list[str]:
    """Names of the built-in families."""
    return sorted(_families())


def _as_list(architectures: str | Sequence[str] | None) -> list[str]:
    if architectures is None:
        return []
    if isinstance(architectures, str):
        return [architectures]
    return list(architectures)


def _lookup(model_type: str | None, architectures: str | Sequence[str] | None, model_id: str | None):
    """Return ``(spec or None, what was asked for)``; first match of type, architectures, id."""
    asked: list[str] = []
    if model_type:
        asked.append(f"model_type {model_type!r}")
        spec = _families().get(model_type.lower())
        if spec is not None:
            return spec, asked
    for arch in _as_list(architectures):
        asked.append(f"architectures {arch!r}")
        for spec in _families().values():
            if arch in spec.hf_architectures:
                return spec, asked
    if model_id:
        asked.append(f"model_id {model_id!r}")
        for spec in _families().values():
            if model_id.lower() in spec.model_ids:
                return spec, asked
    return None, asked


def resolve_family(
    model_type: str | None = None,
    architectures: str | Sequence[str] | None = None,
    model_id: str | None = None,
) -> FamilySpec:
    """Find the built-in family named by ``model_type``, ``architectures`` or ``model_id``.

    Raises:
        ValueError: When none is given or none names a built family (lists the built ones).
    """
    spec, asked = _lookup(model_type, architectures, model_id)
    if spec is not None:
        return spec
    if not asked:
        raise ValueError(
            f"model: no model family given; set model.model_type (built: {', '.join(built_families())})"
        )
    hint = ""
    if model_id and not model_type and not architectures:
        # MindSpeed model_ids without a built-in family (step35, mamba3, minimax_m27, ...) train
        # through the generic transformers path, which needs the model's own folder.
        hint = (
            "; to train it through the generic transformers path, set model.model_name_or_path to a local "
            "Hugging Face folder of the model (transformers must know its model_type, or set "
            "model.trust_remote_code: true for a folder with its own code)"
        )
    raise ValueError(
        f"not supported yet: model family for {' / '.join(asked)}; built: {', '.join(built_families())}{hint}"
    )


def check_model_options(
    model_type: str | None,
    architectures: str | Sequence[str] | None,
    model_id: str | None,
    options: dict[str, Any],
) -> list[tuple[str, str]]:
    """List problems with the ``model:`` passthrough keys, without raising.

    Args:
        model_type: ``model.model_type`` or None.
        architectures: ``model.architectures`` (string or list) or None.
        model_id: MindSpeed ``model_id`` or None.
        options: Only the keys the config system does not declare itself.

    Returns:
        ``(key, reason)`` pairs: one per undeclared key (with a did-you-mean when a
        declared key is close), or a single ``("model_type", ...)`` entry when the
        family is unknown. Empty when everything is declared.
    """
    spec, asked = _lookup(model_type, architectures, model_id)
    if spec is None:
        if not asked:
            return []
        key = "model_type" if model_type else ("architectures" if architectures else "model_id")
        return [
            (
                key,
                f"not supported yet: model family {asked[0].split(' ', 1)[1]}; built: {', '.join(built_families())}",
            )
        ]
    problems = []
    for key in options:
        if key in spec.option_keys:
            continue
        close = difflib.get_close_matches(key, sorted(spec.option_keys), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        problems.append((key, f"not a {spec.name} model option{hint}"))
    return problems


def build_model(
    family: str | FamilySpec, options: dict[str, Any], *, device: str | torch.device = "meta"
) -> nn.Module:
    """Build a model of ``family`` (a name or spec) from its passthrough ``options``."""
    spec = family if isinstance(family, FamilySpec) else resolve_family(model_type=family)
    return spec.build(options, device=device)
