"""Split a Megatron-style command line into flags and their values, as Megatron's argparse would.

How many values a flag takes comes from the flag list (`megatron_flags`), so `--spec MODULE NAME`
(two words) and `--lora-target-modules linear_qkv linear_proj` read whole, and a negative number
after a one-value flag is its value. `--flag=value` is accepted as argparse accepts it. A name in
no argument list is an error with a did-you-mean; a word that belongs to no flag is an error too.
A flag given twice keeps the last value, as argparse does (reported when the values differ).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from meshforge.config.base import Issue, suggest
from meshforge.config.megatron_flags import FLAGS
from meshforge.config.megatron_table import classify

Value = str | list[str] | bool


def _values_for(takes: str, tokens: Sequence[str], start: int) -> tuple[list[str], int]:
    """The values of a flag that takes `takes` starting at `tokens[start]`, and the next index."""
    if takes == "0":
        return [], start
    if takes.isdigit():
        count = int(takes)
        values = list(tokens[start : start + count])
        if any(value.startswith("--") for value in values):
            values = values[: next(k for k, v in enumerate(values) if v.startswith("--"))]
        return values, start + len(values)
    end = start
    while end < len(tokens) and not tokens[end].startswith("--"):
        end += 1
    return list(tokens[start:end]), end


def parse_flags(
    tokens: Sequence[str], say: Callable[[str], None] | None = None
) -> tuple[dict[str, Value], list[Issue]]:
    """`{flag: value}` (True for a switch, a string for one value, a list for several) and issues."""
    tell = say or (lambda _line: None)
    flags: dict[str, Value] = {}
    issues: list[Issue] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("--"):
            issues.append((token, "a value with no flag before it (Megatron flags look like --name VALUE)"))
            continue
        name, eq, inline = token.partition("=")
        if name not in FLAGS:
            guess = suggest(name, list(FLAGS))
            hint = f"; did you mean {guess!r}?" if guess else ""
            issues.append((name, f"unknown flag: in no Megatron-LM or MindSpeed-LLM argument list{hint}"))
            # skip its values so that they are not reported as stray words
            while i < len(tokens) and not tokens[i].startswith("--"):
                i += 1
            continue
        takes = FLAGS[name][0]
        if eq:
            values = [inline]
        else:
            values, i = _values_for(takes, tokens, i)
        value: Value
        if takes != "0" and not values and not eq:
            known = classify(name)
            if known is not None and known.kind == "refused":
                flags[name] = []  # named as not built, whatever its value would have been
                continue
        if takes == "0":
            if eq:
                issues.append((name, f"takes no value, got {inline!r}"))
                continue
            value = True
        elif takes == "1" or (takes.isdigit() and int(takes) == 1):
            if not values:
                issues.append((name, "expects one value"))
                continue
            value = values[0]
        else:
            if takes == "+" and not values:
                issues.append((name, "expects one or more values"))
                continue
            if takes.isdigit() and len(values) != int(takes):
                issues.append((name, f"expects {takes} values, got {len(values)}"))
                continue
            value = values
        if name in flags and flags[name] != value:
            tell(f"{name} given twice ({flags[name]!r}, then {value!r}): the last one counts, as in Megatron")
        flags[name] = value
    return flags, issues
