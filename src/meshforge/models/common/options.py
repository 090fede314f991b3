"""Parsing the ``model:`` passthrough keys into a family's ``*Args``, shared by the families.

Every built-in family's ``args.py`` reads its options the same way: unknown keys are
refused by name with a did-you-mean, alternative spellings (``ALIASES``) are folded
into the field name, numbers may come as YAML 1.1 strings (``"1e-6"``), a bool is
never a number, ``flavor`` picks a named starting point, and the remaining keys
override its fields. This module holds those steps once. A family declares each field
once, in its ``*Args`` dataclass: how a value is read follows from the field's type
(``field_coercer``) and positive sizes are checked with one rule (``require_positive``);
``args.py`` keeps only the family's own extra rules. It does not import torch
(``args.py`` files must load without it).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Generic, NamedTuple, TypeVar

#: The ``*Args`` type a parse starts from (a flavor or the defaults; a family's ``FamilyArgs``).
ArgsT = TypeVar("ArgsT")


def close_match(key: str, known: Collection[str]) -> str | None:
    """The known key closest to ``key``, if one is close enough to suggest."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_option_message(key: str, known: Collection[str], label: str) -> str:
    """Reason text ``unknown <label> option[; did you mean 'x'?]`` for an undeclared key."""
    close = close_match(key, known)
    hint = f"; did you mean {close!r}?" if close else ""
    return f"unknown {label} option{hint}"


def reject_unknown(
    options: Mapping[str, object],
    known: Collection[str],
    label: str,
    *,
    reason: Callable[[str], str] | None = None,
) -> None:
    """Raise for every key of ``options`` not in ``known``, sorted, in one message.

    Args:
        options: The option mapping.
        known: Accepted keys.
        label: The family as messages name it (``Qwen3``, ``gpt-oss``).
        reason: Text put in parentheses after each unknown key; by default only a
            did-you-mean, and nothing when no key is close.

    Raises:
        ValueError: ``unknown <label> model option(s): ...`` when any key is unknown.
    """
    unknown = sorted(k for k in options if k not in known)
    if not unknown:
        return
    parts = []
    for key in unknown:
        if reason is not None:
            parts.append(f"{key!r} ({reason(key)})")
        else:
            close = close_match(key, known)
            parts.append(f"{key!r}" + (f" (did you mean {close!r}?)" if close else ""))
    raise ValueError(f"unknown {label} model option(s): {', '.join(parts)}")


def fold_aliases(options: dict[str, object], aliases: Mapping[str, str], *, lenient: bool = False) -> None:
    """Rename alias keys of ``options`` in place to the field they stand for.

    Args:
        options: The option mapping, modified.
        aliases: Alternative spelling -> field name.
        lenient: Treat a None on either side as unset (the other value wins, the field's
            own value when both are set and equal); otherwise the alias wins and two
            different values are refused, None included.

    Raises:
        ValueError: When both spellings are given with different values.
    """
    for alias, name in aliases.items():
        if alias not in options:
            continue
        if lenient:
            value = options.pop(alias)
            if name in options and options[name] is not None and value is not None and options[name] != value:
                raise ValueError(
                    f"{alias}: is another name for {name}; got both ({value!r} vs {options[name]!r})"
                )
            if options.get(name) is None:
                options[name] = value
        else:
            if name in options and options[name] != options[alias]:
                raise ValueError(
                    f"{alias}: is another name for {name}; got both ({options[alias]!r} vs {options[name]!r})"
                )
            options[name] = options.pop(alias)


def number(key: str, value: object, *, integer: bool) -> int | float:
    """A YAML number spelling (``"1e-6"``, ``"10"``) as int or float; never a bool.

    Raises:
        ValueError: Naming ``key`` when ``value`` is no number, or no integer when ``integer``.
    """
    if isinstance(value, bool):
        raise ValueError(f"{key}: must be a number, got {value!r}")
    try:
        parsed = float(value) if isinstance(value, str) else value
    except ValueError:
        raise ValueError(f"{key}: must be a number, got {value!r}") from None
    if not isinstance(parsed, int | float):
        raise ValueError(f"{key}: must be a number, got {value!r}")
    if integer:
        if not math.isfinite(parsed) or float(parsed) != int(parsed):
            raise ValueError(f"{key}: must be an integer, got {value!r}")
        return int(parsed)
    return float(parsed)


def _scalar(value: object, what: str) -> str | int | float:
    if isinstance(value, str | int | float):
        return value
    raise TypeError(f"must be {what}, got {value!r}")


def as_float(value: object) -> float:
    """``float(value)`` for a value already checked to be a number (or a number's string spelling).

    Raises:
        TypeError: For anything else (what ``float`` raises for None or a list).
    """
    return float(_scalar(value, "a number"))


def as_int(value: object) -> int:
    """``int(value)`` for a value already checked to be an integer (or its string spelling).

    Raises:
        TypeError: For anything else (what ``int`` raises for None or a list).
    """
    return int(_scalar(value, "an integer"))


def coerce_scalar(
    key: str,
    value: object,
    *,
    ints: Collection[str],
    floats: Collection[str],
    bools: Collection[str],
) -> object:
    """Normalise one option value by its field's kind; other fields pass through.

    None stays None; a bool field takes only true/false; int and float fields take
    numbers or their string spellings (``number``).

    Raises:
        ValueError: Naming ``key`` for a value of the wrong kind.
    """
    if value is None:
        return None
    if key in bools:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: must be true or false, got {value!r}")
        return value
    if key in ints or key in floats:
        return number(key, value, integer=key in ints)
    return value


class FieldKinds(NamedTuple):
    """The fields of an ``*Args`` dataclass grouped by how an option value for them is read."""

    ints: frozenset[str]
    floats: frozenset[str]
    bools: frozenset[str]
    int_lists: frozenset[str]


def _kind(hint: object) -> str | None:
    """``int``, ``float``, ``bool`` or ``list[int]`` for a field type (``None`` allowed), else None."""
    origin = typing.get_origin(hint)
    members = typing.get_args(hint) if origin in (types.UnionType, typing.Union) else (hint,)
    members = tuple(m for m in members if m is not type(None))
    if len(members) != 1:
        return None  # e.g. eos_token_id: int | list[int] | None passes through as given
    (only,) = members
    if only in (int, float, bool):
        return only.__name__
    if typing.get_origin(only) is list and typing.get_args(only) == (int,):
        return "list[int]"
    return None


def field_kinds(args_class: type) -> FieldKinds:
    """Group the fields of the dataclass ``args_class`` by their declared type."""
    hints = typing.get_type_hints(args_class)
    found: dict[str, set[str]] = {"int": set(), "float": set(), "bool": set(), "list[int]": set()}
    for item in dataclasses.fields(args_class):
        kind = _kind(hints[item.name])
        if kind is not None:
            found[kind].add(item.name)
    return FieldKinds(*(frozenset(found[k]) for k in ("int", "float", "bool", "list[int]")))


def field_coercer(args_class: type) -> Callable[[str, object], object]:
    """``(key, value) -> value`` reading an option by the type of its field in ``args_class``.

    ``int``/``float`` fields take numbers or their string spellings, ``bool`` fields only
    true/false, ``list[int]`` fields a list of such integers; None stays None and other
    fields pass through (the dataclass checks them).
    """
    kinds = field_kinds(args_class)

    def coerce(key: str, value: object) -> object:
        if key in kinds.int_lists and value is not None:
            if not isinstance(value, list | tuple):
                raise ValueError(f"{key}: must be a list of integers, got {value!r}")
            return [number(f"{key}[{i}]", v, integer=True) for i, v in enumerate(value)]
        return coerce_scalar(key, value, ints=kinds.ints, floats=kinds.floats, bools=kinds.bools)

    return coerce


def require_positive(args: object, names: Collection[str]) -> None:
    """The one positivity rule of sizes: each named field of ``args`` is an int > 0 (never a bool).

    Raises:
        ValueError: ``<name>: must be a positive integer, got <value>`` for the first that is not.
    """
    for name in names:
        positive_int(name, getattr(args, name))


def positive_int(name: str, value: object) -> None:
    """Raise ``<name>: must be a positive integer, got <value>`` unless ``value`` is an int > 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


class ParsedOptions(NamedTuple, Generic[ArgsT]):
    """What ``parse_options`` hands back for the family to finish with ``replace(base, **overrides)``."""

    base: ArgsT
    overrides: dict[str, object]
    flavor: str | None


def parse_options(
    options: Mapping[str, object],
    *,
    label: str,
    known: Collection[str],
    flavors: Mapping[str, ArgsT],
    default: Callable[[], ArgsT],
    coerce: Callable[[str, object], object],
    aliases: Mapping[str, str] | None = None,
    lenient_aliases: bool = False,
    unknown_reason: Callable[[str], str] | None = None,
) -> ParsedOptions[ArgsT]:
    """The common steps of a family's ``from_options``, in order.

    Unknown keys are refused (``reject_unknown``), aliases folded (``fold_aliases``),
    every value coerced with ``coerce``, and ``flavor`` resolved to its ``*Args`` (or
    ``default()`` without one).

    Args:
        options: The ``model:`` passthrough keys.
        label: The family as messages name it.
        known: Accepted keys (fields, ``flavor``, aliases).
        flavors: Flavor name -> ``*Args``.
        default: Builds the ``*Args`` used without a flavor.
        coerce: ``(key, value) -> value`` for one option.
        aliases: Alternative spelling -> field name.
        lenient_aliases: Passed to ``fold_aliases`` as ``lenient``.
        unknown_reason: Passed to ``reject_unknown`` as ``reason``.

    Returns:
        The starting ``*Args``, the coerced overrides (``flavor`` removed) and the flavor.

    Raises:
        ValueError: For an unknown key, conflicting aliases, an invalid value or an
            unknown flavor.
    """
    reject_unknown(options, known, label, reason=unknown_reason)
    overrides = dict(options)
    if aliases:
        fold_aliases(overrides, aliases, lenient=lenient_aliases)
    overrides = {k: coerce(k, v) for k, v in overrides.items()}
    flavor = overrides.pop("flavor", None)
    base: ArgsT
    if flavor is None:
        base = default()
    elif flavor in flavors:
        assert isinstance(flavor, str)  # the flavors' keys are names
        base = flavors[flavor]
    else:
        raise ValueError(f"flavor: unknown {label} flavor {flavor!r}; use one of {sorted(flavors)}")
    return ParsedOptions(base, overrides, flavor)


__all__ = [
    "FieldKinds",
    "ParsedOptions",
    "as_float",
    "as_int",
    "close_match",
    "coerce_scalar",
    "field_coercer",
    "field_kinds",
    "fold_aliases",
    "number",
    "parse_options",
    "positive_int",
    "reject_unknown",
    "require_positive",
    "unknown_option_message",
]
