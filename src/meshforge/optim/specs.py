"""What the `optimizer:` and `lr_scheduler:` passthrough keys may contain, per type.

Both sections are `allow_extra` in the MindFormers format: besides their declared fields
(`type`, `betas`, ... / `type`, `learning_rate`) they carry keys that belong to the chosen
optimizer or scheduler (`warmup_ratio`, `lr_end`, ...). Each type declares them once, as the
fields of its options dataclass in `optim/options.py`; this module derives the table of keys, types
and ranges from those fields, so that

* the config system can report every wrong key at load time (`check_*_options`, returning
  `(key relative to the section, reason)` pairs, never raising), and
* the builders get an instance of that dataclass, alias-resolved (`resolve_*_options`, raising
  `ValueError` that names `lr_scheduler.<key>`).

Numbers follow the project rule: `1e-8` and `"10"` are accepted (PyYAML reads `1e-8` as a
string), a bool is never a number, NaN and infinities are rejected.

Light module: no torch import.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from meshforge.optim.options import (
    OPTIMIZER_OPTIONS,
    SCHEDULER_OPTIONS,
    AdamWOptions,
    FusedAdamWOptions,
    MuonOptions,
    SchedulerOptions,
)

__all__ = [
    "OPTIMIZER_SPECS",
    "OPTIMIZERS_BUILT",
    "OPTIMIZERS_PLANNED",
    "SCHEDULER_SPECS",
    "SCHEDULERS_BUILT",
    "SCHEDULERS_PLANNED",
    "OptionSpec",
    "canonical_optimizer_type",
    "canonical_scheduler_type",
    "check_optimizer_options",
    "check_scheduler_options",
    "optimizer_not_built",
    "resolve_optimizer_options",
    "resolve_scheduler_options",
    "scheduler_not_built",
]

Kind = Literal["int", "float", "bool", "optional_bool", "float_triple"]


@dataclass(frozen=True)
class OptionSpec:
    """One passthrough key.

    Attributes:
        name: the key as written in YAML.
        kind: `int`, `float`, `bool`, `optional_bool` (true/false/null), or `float_triple`
            (a list of three numbers, e.g. Muon's `ns_coefficients`).
        description: one line, shown by `config schema` and in docs.
        default: value used when the key is absent (None means "not set").
        lo, hi: inclusive bounds (None = unbounded); `lo_open`/`hi_open` make them exclusive.
        alias_of: canonical key this one is another name for (e.g. `min_lr` -> `lr_end`).
        required: the type cannot be built without this key.
    """

    name: str
    kind: Kind
    description: str
    default: Any = None
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    alias_of: str | None = None
    required: bool = False

    def range_text(self) -> str:
        left = "(" if self.lo_open else "["
        right = ")" if self.hi_open else "]"
        lo = "-inf" if self.lo is None else f"{self.lo:g}"
        hi = "inf" if self.hi is None else f"{self.hi:g}"
        return f"{left}{lo}, {hi}{right}"


# ----------------------------------------------------------------------------- types

# `FusedAdamW` is MindSpeed's `optimizer: fused_adamw`: AdamW with the fused kernel forced.
OPTIMIZERS_BUILT: tuple[str, ...] = tuple(OPTIMIZER_OPTIONS)
# Declared by the references but not built yet: `config validate` accepts them, `train` refuses
# them (see `optimizer_not_built`). Empty: every referenced optimizer is built.
OPTIMIZERS_PLANNED: tuple[str, ...] = ()

SCHEDULERS_BUILT: tuple[str, ...] = tuple(SCHEDULER_OPTIONS)
# Other MindFormers schedule names: recognised, refused by `train` until built. Empty: every
# referenced schedule is built.
SCHEDULERS_PLANNED: tuple[str, ...] = ()


def _kind(hint: Any) -> Kind:
    if typing.get_origin(hint) is tuple and typing.get_args(hint) == (float, float, float):
        return "float_triple"
    members = [m for m in typing.get_args(hint) if m is not type(None)] or [hint]
    optional = type(None) in typing.get_args(hint)
    if members == [bool]:
        return "optional_bool" if optional else "bool"
    if members == [int]:
        return "int"
    if members == [float]:
        return "float"
    raise TypeError(f"option type {hint!r} is not int, float or bool (optionally | None)")


def specs_of(options_class: type) -> dict[str, OptionSpec]:
    """The keys of one type, from the fields of its options dataclass (aliases after their field)."""
    hints = typing.get_type_hints(options_class)
    table: dict[str, OptionSpec] = {}
    for item in dataclasses.fields(options_class):
        meta = item.metadata
        kind = _kind(hints[item.name])
        bounds = {k: meta[k] for k in ("lo", "hi", "lo_open", "hi_open")}
        default = None if item.default is dataclasses.MISSING else item.default
        table[item.name] = OptionSpec(
            item.name, kind, meta["description"], default=default, required=meta["required"], **bounds
        )
        for alias, text in meta["aliases"].items():
            table[alias] = OptionSpec(alias, kind, text, alias_of=item.name, **bounds)
    return table


OPTIMIZER_SPECS: dict[str, dict[str, OptionSpec]] = {
    name: specs_of(cls) for name, cls in OPTIMIZER_OPTIONS.items()
}
SCHEDULER_SPECS: dict[str, dict[str, OptionSpec]] = {
    name: specs_of(cls) for name, cls in SCHEDULER_OPTIONS.items()
}

# Pairs that contradict each other when both are given (neither has precedence).
_EXCLUSIVE: dict[str, tuple[tuple[str, str], ...]] = {
    "LinearWithWarmUpLR": (("lr_end", "min_lr"),),
    "CosineWithWarmUpLR": (("lr_end", "min_lr"),),
    "WarmUpStableDecayLR": (("lr_end", "min_lr"), ("decay_start_ratio", "decay_ratio")),
    "PolynomialWithWarmUpLR": (("lr_end", "min_lr"),),
    "CosineWithRestartsAndWarmUpLR": (("lr_end", "min_lr"),),
}

# ----------------------------------------------------------------------------- helpers


def _canonical(type_name: str, names: tuple[str, ...]) -> str | None:
    lowered = {n.lower(): n for n in names}
    return lowered.get(type_name.lower()) if isinstance(type_name, str) else None


def canonical_optimizer_type(type_name: str) -> str | None:
    """The canonical spelling of a known optimizer type (built or planned), matched
    case-insensitively (MindSpeed writes `adamw`), or None when unknown."""
    return _canonical(type_name, OPTIMIZERS_BUILT + OPTIMIZERS_PLANNED)


def canonical_scheduler_type(type_name: str) -> str | None:
    """The canonical spelling of a known scheduler type (built or planned), or None."""
    return _canonical(type_name, SCHEDULERS_BUILT + SCHEDULERS_PLANNED)


def optimizer_not_built(type_name: str) -> str | None:
    """`not supported yet: optimizer.type=Muon; built: AdamW` for a recognised type that is not
    built yet; None for a built or unknown type (unknown types are `check_*` errors)."""
    canon = canonical_optimizer_type(type_name)
    if canon in OPTIMIZERS_PLANNED:
        return f"not supported yet: optimizer.type={canon}; built: {', '.join(OPTIMIZERS_BUILT)}"
    return None


def scheduler_not_built(type_name: str | None) -> str | None:
    """Like `optimizer_not_built`, for `lr_scheduler.type`."""
    if type_name is None:
        return None
    canon = canonical_scheduler_type(type_name)
    if canon in SCHEDULERS_PLANNED:
        return f"not supported yet: lr_scheduler.type={canon}; built: {', '.join(SCHEDULERS_BUILT)}"
    return None


def _unknown_type(kind: str, type_name: Any, built: tuple[str, ...], planned: tuple[str, ...]) -> str:
    hint = ""
    if isinstance(type_name, str):
        close = difflib.get_close_matches(type_name, built + planned, n=1, cutoff=0.5)
        if close:
            hint = f"; did you mean {close[0]!r}?"
    return f"unknown {kind} type {type_name!r}; built: {', '.join(built)}{hint}"


def _coerce(spec: OptionSpec, value: Any) -> tuple[Any, str | None]:
    """Convert `value` to the spec's kind and check its range: (converted, error or None)."""
    if spec.kind == "float_triple":
        return _coerce_triple(value)
    if spec.kind in ("bool", "optional_bool"):
        if value is None and spec.kind == "optional_bool":
            return None, None
        if isinstance(value, bool):
            return value, None
        return None, f"expected true or false, got {value!r}"
    if value is None:
        return None, None  # YAML null: the key is "not set"
    if isinstance(value, bool):
        return None, f"expected a number, got the bool {value!r}"
    num: float | int
    if isinstance(value, int):
        num = value
    elif isinstance(value, float):
        num = value
    elif isinstance(value, str):
        try:
            num = int(value.strip())
        except ValueError:
            try:
                num = float(value.strip())
            except ValueError:
                return None, f"expected a number, got {value!r}"
    else:
        return None, f"expected a number, got {type(value).__name__} {value!r}"
    if isinstance(num, float) and not math.isfinite(num):
        return None, f"must be finite, got {value!r}"
    if spec.kind == "int":
        if isinstance(num, float):
            if not num.is_integer():
                return None, f"expected an integer, got {value!r}"
            num = int(num)
    else:
        num = float(num)
    too_low = spec.lo is not None and (num <= spec.lo if spec.lo_open else num < spec.lo)
    too_high = spec.hi is not None and (num >= spec.hi if spec.hi_open else num > spec.hi)
    if too_low or too_high:
        return None, f"must be in {spec.range_text()}, got {value!r}"
    return num, None


def _coerce_triple(value: Any) -> tuple[Any, str | None]:
    if value is None:
        return None, None
    if isinstance(value, str) or not isinstance(value, list | tuple) or len(value) != 3:
        return None, f"expected a list of three numbers [a, b, c], got {value!r}"
    element = OptionSpec("", "float", "")
    out: list[float] = []
    for i, item in enumerate(value):
        num, err = _coerce(element, item)
        if err or num is None:
            return None, f"item [{i}]: {err or 'expected a number, got null'}"
        out.append(num)
    return tuple(out), None


def _unknown_key(key: str, allowed: list[str], owner: str) -> str:
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    accepted = ", ".join(allowed) if allowed else "none"
    return f"unknown key for {owner}{hint} (accepted: {accepted})"


def _check(
    table: Mapping[str, OptionSpec],
    options: Mapping[str, object],
    owner: str,
    exclusive: tuple[tuple[str, str], ...],
) -> tuple[dict[str, object], list[tuple[str, str]]]:
    values: dict[str, object] = {}
    problems: list[tuple[str, str]] = []
    for key, raw in options.items():
        spec = table.get(key)
        if spec is None:
            problems.append((str(key), _unknown_key(str(key), list(table), owner)))
            continue
        value, err = _coerce(spec, raw)
        if err:
            problems.append((key, err))
        elif value is not None:
            values[key] = value
    for a, b in exclusive:
        if a in values and b in values:
            problems.append((b, f"conflicts with {a}: give only one of them"))
    for name, spec in table.items():
        if spec.required and values.get(name) is None and all(k != name for k, _ in problems):
            problems.append((name, f"required for {owner}: {spec.description}"))
    return values, problems


# ----------------------------------------------------------------------------- public checks


def check_optimizer_options(type_name: str, options: Mapping[str, object]) -> list[tuple[str, str]]:
    """Problems with the `optimizer:` passthrough keys for `type_name`.

    Args:
        type_name: `optimizer.type` (matched case-insensitively).
        options: the undeclared keys of the section (pydantic's `model_extra`).

    Returns:
        `(key relative to the section, reason)` pairs; `("type", ...)` for an unknown type.
        Empty when everything is valid. A recognised type that is not built yet is not an
        error here (see `optimizer_not_built`); its options are not checked.
    """
    canon = canonical_optimizer_type(type_name)
    if canon is None:
        return [("type", _unknown_type("optimizer", type_name, OPTIMIZERS_BUILT, OPTIMIZERS_PLANNED))]
    if canon not in OPTIMIZER_SPECS:
        return []
    return _check(OPTIMIZER_SPECS[canon], options, f"optimizer type {canon}", ())[1]


def check_scheduler_options(type_name: str | None, options: Mapping[str, object]) -> list[tuple[str, str]]:
    """Problems with the `lr_scheduler:` passthrough keys for `type_name`.

    `type_name=None` means a constant learning rate, which takes no options: every key is then
    reported. See `check_optimizer_options` for the return format.
    """
    if type_name is None:
        return [
            (
                str(key),
                "lr_scheduler.type is not set, so the learning rate is constant and this key has no "
                f"effect; set lr_scheduler.type to one of {', '.join(SCHEDULERS_BUILT)}",
            )
            for key in options
        ]
    canon = canonical_scheduler_type(type_name)
    if canon is None:
        return [("type", _unknown_type("lr_scheduler", type_name, SCHEDULERS_BUILT, SCHEDULERS_PLANNED))]
    if canon not in SCHEDULER_SPECS:
        return []
    return _check(SCHEDULER_SPECS[canon], options, f"lr_scheduler type {canon}", _EXCLUSIVE.get(canon, ()))[1]


def _raise_first(section: str, problems: list[tuple[str, str]]) -> None:
    if problems:
        lines = [f"{section}.{key}: {reason}" for key, reason in problems]
        raise ValueError("\n".join(lines))


def resolve_optimizer_options(
    type_name: str, options: Mapping[str, object]
) -> tuple[str, AdamWOptions | FusedAdamWOptions | MuonOptions]:
    """Validate and convert `optimizer:` passthrough keys for a built optimizer.

    Returns:
        `(canonical type, its options)` with defaults filled in.

    Raises:
        ValueError: `optimizer.<key>: <reason>` (one line per problem); for a type that is not
            built, `not supported yet: optimizer.type=...`.
    """
    problems = check_optimizer_options(type_name, options)
    _raise_first("optimizer", problems)
    not_built = optimizer_not_built(type_name)
    if not_built:
        raise ValueError(not_built)
    canon = canonical_optimizer_type(type_name)
    assert canon is not None
    values, _ = _check(OPTIMIZER_SPECS[canon], options, canon, ())
    return canon, OPTIMIZER_OPTIONS[canon](**_folded(OPTIMIZER_SPECS[canon], values))


def resolve_scheduler_options(
    type_name: str | None, options: Mapping[str, object]
) -> tuple[str | None, SchedulerOptions]:
    """Validate and convert `lr_scheduler:` passthrough keys for a built scheduler.

    Aliases are folded into their canonical key (`min_lr` -> `lr_end`); absent keys get their
    default (None for "not set").

    Returns:
        `(canonical type or None, its options)`; a constant rate (no type) has no options.

    Raises:
        ValueError: `lr_scheduler.<key>: <reason>`, or `not supported yet: lr_scheduler.type=...`.
    """
    _raise_first("lr_scheduler", check_scheduler_options(type_name, options))
    if type_name is None:
        return None, SchedulerOptions()
    not_built = scheduler_not_built(type_name)
    if not_built:
        raise ValueError(not_built)
    canon = canonical_scheduler_type(type_name)
    assert canon is not None
    values, _ = _check(SCHEDULER_SPECS[canon], options, canon, ())
    return canon, SCHEDULER_OPTIONS[canon](**_folded(SCHEDULER_SPECS[canon], values))


def _folded(table: Mapping[str, OptionSpec], values: Mapping[str, object]) -> dict[str, object]:
    """Checked values by field name: an alias given counts for its field; absent keys are left out."""
    out = {name: values[name] for name, spec in table.items() if spec.alias_of is None and name in values}
    for name, spec in table.items():
        if spec.alias_of is not None and name in values:
            out[spec.alias_of] = values[name]
    return out
