"""Model-family registry: the list of family specs, and which one a config or a model names.

A family is found by any of the three names a config may carry: transformers'
``model_type`` (``qwen3``), an ``architectures`` entry (``Qwen3ForCausalLM``, a
string or a list as in ``config.json``) or MindSpeed's ``model_id``. The registry
is light (no torch at import; the config system uses it to check ``model:``
passthrough keys): each ``spec.py`` imports only its family's ``args.py``, and the spec's
functions import the family's heavy modules when called.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from meshforge.models.deepseek_v3.spec import FAMILY as DEEPSEEK_V3
from meshforge.models.generic.spec import FAMILY as GENERIC_FAMILY
from meshforge.models.gpt_oss.spec import FAMILY as GPT_OSS
from meshforge.models.llama.spec import FAMILY as LLAMA
from meshforge.models.mamba3.spec import FAMILY as MAMBA3
from meshforge.models.minimax_m2.spec import FAMILY as MINIMAX_M2
from meshforge.models.qwen3.spec import FAMILY as QWEN3
from meshforge.models.qwen3_moe.spec import FAMILY as QWEN3_MOE
from meshforge.models.qwen3_next.spec import FAMILY as QWEN3_NEXT
from meshforge.models.spec import GENERIC, FamilySpec
from meshforge.models.step3p5.spec import FAMILY as STEP3P5

if TYPE_CHECKING:
    import torch
    from torch import nn

# The built-in families, one line each: adding a family is a folder `models/<family>/` with its
# `spec.py`, plus its line here.
SPECS: tuple[FamilySpec, ...] = (
    QWEN3,
    LLAMA,
    QWEN3_MOE,
    DEEPSEEK_V3,
    GPT_OSS,
    QWEN3_NEXT,
    MAMBA3,
    MINIMAX_M2,
    STEP3P5,
)
_FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in SPECS}
# By a model class' `family`: the built-in families, and the transformers path's wrapped models
# (their spec is built per folder, so `FAMILY` holds its pieces without one).
_MODEL_FAMILIES: dict[str, FamilySpec] = {**_FAMILIES, GENERIC: GENERIC_FAMILY}


def _families() -> dict[str, FamilySpec]:
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


def _lookup(
    model_type: str | None, architectures: str | Sequence[str] | None, model_id: str | None
) -> tuple[FamilySpec | None, list[str]]:
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


def find_family(
    model_type: str | None = None,
    architectures: str | Sequence[str] | None = None,
    model_id: str | None = None,
) -> FamilySpec | None:
    """The built-in family these names select, or None (nothing given, or a generic-path model)."""
    return _lookup(model_type, architectures, model_id)[0]


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
        # MindSpeed model_ids without a built-in family (glm52, deepseek_v4, ...) train
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
    options: dict[str, object],
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
    family: str | FamilySpec, options: dict[str, object], *, device: str | torch.device = "meta"
) -> nn.Module:
    """Build a model of ``family`` (a name or spec) from its passthrough ``options``."""
    spec = family if isinstance(family, FamilySpec) else resolve_family(model_type=family)
    return spec.build(options, device=device)


def spec_of_model_class(cls: type) -> FamilySpec | None:
    """The spec of a model class (its ``family`` class attribute), else None.

    A wrapped transformers model (``family`` = ``GENERIC``) gets the transformers path's pieces
    (``models/generic/spec.py``: ``FAMILY``, the same for every folder).
    """
    name = getattr(cls, "family", None)
    return _MODEL_FAMILIES.get(name) if isinstance(name, str) else None


def spec_of_model(model: nn.Module) -> FamilySpec | None:
    """The spec of a family's model (or pipeline stage of one), else None."""
    return spec_of_model_class(type(model))


def kv_cache_families() -> list[str]:
    """Names of the built-in families meshforge's generation cache runs (``FamilySpec.kv_cache``)."""
    return sorted(name for name, spec in _FAMILIES.items() if spec.kv_cache is not None)


def expert_types() -> tuple[type[nn.Module], ...]:
    """The experts container classes of every MoE family (imports their modules)."""
    types = {spec.moe.expert_type() for spec in _FAMILIES.values() if spec.moe is not None}
    return tuple(sorted(types, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}"))


def expert_count_keys() -> dict[str, str]:
    """``family -> model.* key`` of the routed-expert count, for the MoE families."""
    return {name: spec.moe.expert_count_key for name, spec in _FAMILIES.items() if spec.moe is not None}
