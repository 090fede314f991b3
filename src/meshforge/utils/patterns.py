"""Module-name patterns shared by every config key that names modules.

Keys such as `parallel.fsdp_modules`, `tp_colwise`, `recompute_modules` and the optimizer's
weight-decay rules name modules with a small pattern language (MindSpeed-LLM's module
matcher), so that `model.layers.{*}.mlp.experts` and `*.q_proj`
mean the same thing for built-in models and for any Hugging Face model:

| token   | matches                                                                    |
| ------- | -------------------------------------------------------------------------- |
| `{*}`   | one non-negative integer (digits only), e.g. a layer index                 |
| `{}`    | the same as `{*}` (MindSpeed documents `{}` but its code rejects it)        |
| `{a-b}` | an integer within `a..b`, inclusive                                        |
| `*`     | any run of characters, dots included (`*.q_proj` matches every q_proj)     |
| `?`     | exactly one character                                                      |
| other   | itself                                                                     |

A pattern is anchored at both ends: `model.layers.{*}` matches `model.layers.3` but not
`model.layers.3.mlp`, and `*gate` does not match `gate_proj`.

This module is light: it does not import torch; `match_modules` takes anything with a
`named_modules()` method.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["ModulePattern", "compile_pattern", "is_pattern", "match_modules", "suggest_names"]

# Characters that turn a weight-decay entry (or any name rule) from a substring into a pattern.
_PATTERN_CHARS = frozenset("*?{")
_RANGE = re.compile(r"^(\d+)-(\d+)$")


class _HasNamedModules(Protocol):
    def named_modules(self) -> Iterable[tuple[str, Any]]: ...


@dataclass(frozen=True)
class ModulePattern:
    """A compiled module pattern.

    Attributes:
        pattern: the text as written by the user.
        regex: the anchored regular expression it compiles to.
        ranges: for each `{a-b}` token, in order, the inclusive bounds its integer must fall in;
            `None` for `{*}`/`{}` tokens.
    """

    pattern: str
    regex: re.Pattern[str]
    ranges: tuple[tuple[int, int] | None, ...]

    def matches(self, name: str) -> bool:
        """Whether `name` (a dotted module or parameter path) matches the whole pattern."""
        m = self.regex.fullmatch(name)
        if m is None:
            return False
        for value, bounds in zip(m.groups(), self.ranges):
            if bounds is not None and not bounds[0] <= int(value) <= bounds[1]:
                return False
        return True

    def __str__(self) -> str:
        return self.pattern


def is_pattern(entry: str) -> bool:
    """Whether a name rule uses pattern syntax (`*`, `?` or `{`) rather than a plain substring."""
    return any(c in _PATTERN_CHARS for c in entry)


def compile_pattern(pattern: str) -> ModulePattern:
    """Compile a module pattern (see the module docstring for the syntax).

    Args:
        pattern: e.g. `model.layers.{*}.mlp`, `model.layers.{0-3}`, `*.q_proj`.

    Returns:
        The compiled pattern.

    Raises:
        ValueError: the pattern is empty or not a string, has an unclosed `{`, a stray `}`,
            or a brace token other than `{*}`, `{}` and `{a-b}` with `a <= b`.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"module pattern {pattern!r}: must be a non-empty string")
    parts: list[str] = []
    ranges: list[tuple[int, int] | None] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "{":
            end = pattern.find("}", i + 1)
            if end < 0:
                raise ValueError(f"module pattern {pattern!r}: '{{' at position {i} is never closed")
            body = pattern[i + 1 : end].strip()
            if body in ("", "*"):
                ranges.append(None)
            else:
                m = _RANGE.match(body)
                if m is None:
                    raise ValueError(
                        f"module pattern {pattern!r}: unrecognised brace '{{{body}}}'; "
                        "use {*} (any index) or {a-b} (indices a..b inclusive)"
                    )
                lo, hi = int(m.group(1)), int(m.group(2))
                if lo > hi:
                    raise ValueError(f"module pattern {pattern!r}: empty range '{{{body}}}' ({lo} > {hi})")
                ranges.append((lo, hi))
            parts.append(r"(\d+)")
            i = end + 1
            continue
        if c == "}":
            raise ValueError(f"module pattern {pattern!r}: '}}' at position {i} has no matching '{{'")
        if c == "*":
            parts.append(".*")
        elif c == "?":
            parts.append(".")
        else:
            parts.append(re.escape(c))
        i += 1
    return ModulePattern(pattern=pattern, regex=re.compile("".join(parts)), ranges=tuple(ranges))


def suggest_names(wanted: str, names: Sequence[str], *, limit: int = 4) -> list[str]:
    """A few real names to show next to a rule that matched nothing.

    Names are ranked by similarity to `wanted` (pattern tokens removed), comparing against the
    whole name and against each dotted component, so that `biass` finds `...q_proj.bias`. Only
    one name per layer-independent shape is shown (`model.layers.0.mlp` stands for every layer),
    so the examples differ from each other.
    """
    names = [n for n in names if n]
    if not names:
        return []
    probe = re.sub(r"\{[^}]*\}", "0", wanted).replace("*", "").replace("?", "").strip(".")

    def score(name: str) -> float:
        parts = [name, *name.split(".")]
        return max(difflib.SequenceMatcher(None, probe, p).ratio() for p in parts)

    shapes: dict[str, str] = {}
    for n in names:
        shapes.setdefault(re.sub(r"(?<=\.)\d+(?=\.|$)", "N", n), n)
    representatives = list(shapes.values())
    ranked = sorted(representatives, key=score, reverse=True) if probe else representatives
    return ranked[:limit]


def match_modules(
    model: _HasNamedModules, patterns: Sequence[str], *, key_path: str, allow_unmatched: bool = False
) -> list[tuple[str, Any]]:
    """Find the modules of `model` whose dotted names match any of `patterns`.

    Args:
        model: an `nn.Module` (anything with `named_modules()`).
        patterns: pattern strings, typically a config list such as `parallel.fsdp_modules`.
        key_path: the config key the list came from, used in error messages.
        allow_unmatched: accept a pattern that matches nothing here (a pipeline stage holds part
            of the model; the caller checks the patterns over all stages).

    Returns:
        `(name, module)` pairs in `named_modules()` order, each module once even when several
        patterns match it.

    Raises:
        ValueError: `<key_path>[i]: ...` when pattern i is invalid or matches no module; the
            message shows a few real module names.
    """
    compiled: list[ModulePattern] = []
    for i, p in enumerate(patterns):
        try:
            compiled.append(compile_pattern(p))
        except ValueError as e:
            raise ValueError(f"{key_path}[{i}]: {e}") from None
    named = list(model.named_modules())
    hits = [False] * len(compiled)
    out: list[tuple[str, Any]] = []
    for name, module in named:
        matched = False
        for j, pat in enumerate(compiled):
            if pat.matches(name):
                hits[j] = True
                matched = True
        if matched:
            out.append((name, module))
    for i, hit in enumerate(hits):
        if not hit and not allow_unmatched:
            examples = ", ".join(suggest_names(patterns[i], [n for n, _ in named]))
            raise ValueError(f"{key_path}[{i}]: pattern {patterns[i]!r} matches no module; e.g. {examples}")
    return out
