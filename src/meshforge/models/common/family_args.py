"""``FamilyArgs``: the base of every family's ``*Args`` dataclass, holding the shared ``from_options``.

A family's ``args.py`` declares its frozen dataclass (the fields, their transformers defaults,
``__post_init__`` checks) and subclasses :class:`FamilyArgs`, which turns the ``model:``
passthrough keys into an instance in the steps of :func:`~meshforge.models.common.options.parse_options`
(unknown keys refused by name, aliases folded, values read by their field's type, ``flavor``
resolved) and then ``replace(base, **overrides)``. What differs between families is data on the
class (``label``, ``aliases``, ...) and two small hooks, :meth:`FamilyArgs.prepare_options`
before the parse and :meth:`FamilyArgs.finish_options` after it. No torch here (``args.py``
files must load without it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import Field
from typing import ClassVar, Self

from meshforge.models.common.options import (
    ParsedOptions,
    field_coercer,
    parse_options,
    unknown_option_message,
)

# One coercer per args class: field_coercer reads the type hints, which is worth doing once.
_COERCERS: dict[type, Callable[[str, object], object]] = {}


class FamilyArgs:
    """Base of a family's frozen ``*Args`` dataclass: ``from_options`` and the option keys.

    Class attributes a family sets (``ClassVar`` in its dataclass, so they are no fields):

    Attributes:
        label: The family as messages name it (``Qwen3``, ``gpt-oss``).
        aliases: Alternative spelling -> field name (``num_experts`` for ``num_local_experts``).
        lenient_aliases: A None on either spelling counts as unset (``fold_aliases``' ``lenient``).
        extra_option_keys: Accepted keys that are neither fields, aliases nor ``flavor`` (the
            family's ``prepare_options`` or ``coerce_option`` deals with them).
        label_unknown: Each unknown key's reason names the family (``unknown Qwen3 option; did
            you mean ...``) instead of giving only the did-you-mean.
    """

    # Set by ``@dataclass`` on every subclass; declared so ``dataclasses.fields`` / ``replace``
    # accept the base (it makes the class a typeshed ``DataclassInstance``).
    __dataclass_fields__: ClassVar[dict[str, Field[object]]]

    label: ClassVar[str] = ""
    aliases: ClassVar[Mapping[str, str]] = {}
    lenient_aliases: ClassVar[bool] = False
    extra_option_keys: ClassVar[frozenset[str]] = frozenset()
    label_unknown: ClassVar[bool] = False

    @classmethod
    def option_keys(cls) -> frozenset[str]:
        """Every accepted ``model:`` key: the fields, ``flavor``, the aliases and the extra keys."""
        names = frozenset(f.name for f in dataclasses.fields(cls))
        return names | {"flavor"} | set(cls.aliases) | cls.extra_option_keys

    @classmethod
    def flavors(cls) -> Mapping[str, Self]:
        """The named starting points (``tiny``, ``debug``); a family returns its ``FLAVORS``."""
        return {}

    @classmethod
    def coerce_option(cls, key: str, value: object) -> object:
        """One option value read by its field's type (``field_coercer``); a family may add rules."""
        coerce = _COERCERS.get(cls)
        if coerce is None:
            coerce = _COERCERS[cls] = field_coercer(cls)
        return coerce(key, value)

    @classmethod
    def prepare_options(cls, options: dict[str, object]) -> dict[str, object]:
        """Hook before the parse, on a copy of the options: take out keys that are no fields."""
        return options

    @classmethod
    def apply_overrides(cls, base: Self, overrides: Mapping[str, object]) -> Self:
        """``replace(base, **overrides)``: each value is checked by the dataclass (``__post_init__``)."""
        return dataclasses.replace(base, **overrides)

    @classmethod
    def finish_options(cls, parsed: ParsedOptions[Self], options: Mapping[str, object]) -> Self:
        """Hook after the parse: the flavor (or defaults) with the overrides applied.

        Args:
            parsed: The starting args, the coerced overrides and the flavor name.
            options: The options as given (before ``prepare_options``).
        """
        return cls.apply_overrides(parsed.base, parsed.overrides)

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> Self:
        """Build the args from the ``model:`` passthrough keys.

        ``flavor`` picks a named starting point; the other keys override its fields. Without
        a flavor the transformers defaults apply. Numbers may be given as strings (``"1e-6"``,
        as YAML 1.1 reads them); a bool is never taken as a number.

        Raises:
            ValueError: For an unknown key (named, with a suggestion), an unknown flavor, a key
                given under two spellings with different values, or an invalid value (named).
        """
        known = cls.option_keys()
        reason = (lambda key: unknown_option_message(key, known, cls.label)) if cls.label_unknown else None
        parsed = parse_options(
            cls.prepare_options(dict(options)),
            label=cls.label,
            known=known,
            flavors=cls.flavors(),
            default=cls,
            coerce=cls.coerce_option,
            aliases=cls.aliases,
            lenient_aliases=cls.lenient_aliases,
            unknown_reason=reason,
        )
        return cls.finish_options(parsed, options)


__all__ = ["FamilyArgs"]
