"""The parsed flags of one Megatron command line, read typed, and the native dict they fill.

`Flags` reads a flag's value as Megatron's argparse type would (int, float, words) and records a
bad value as an issue naming the flag; `Native` writes a native key path and logs the line every
read flag gets: `--tensor-model-parallel-size 2 -> parallelism.tensor_parallel: 2`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from meshforge.config.base import Issue
from meshforge.config.megatron_cmdline import Value


class Flags:
    """The given flags with typed getters; every getter marks the flag as read."""

    def __init__(self, given: dict[str, Value], issues: list[Issue]) -> None:
        self.given = given
        self.issues = issues
        self.read: set[str] = set()

    def __contains__(self, flag: str) -> bool:
        return flag in self.given

    def on(self, flag: str) -> bool:
        self.read.add(flag)
        return self.given.get(flag) is True

    def text(self, flag: str, default: str | None = None) -> str | None:
        self.read.add(flag)
        value = self.given.get(flag)
        if value is None:
            return default
        if isinstance(value, list):
            return " ".join(value)
        return str(value)

    def words(self, flag: str) -> list[str]:
        self.read.add(flag)
        value = self.given.get(flag)
        if value is None or value is True:
            return []
        return value if isinstance(value, list) else [str(value)]

    def number(self, flag: str, kind: type[int] | type[float], default: float | None = None) -> float | None:
        text = self.text(flag)
        if text is None:
            return default
        try:
            return kind(text)
        except ValueError:
            self.issues.append((flag, f"expects {'an integer' if kind is int else 'a number'}, got {text!r}"))
            return None

    def int(self, flag: str, default: int | None = None) -> int | None:
        value = self.number(flag, int, default)
        return None if value is None else int(value)

    def float(self, flag: str, default: float | None = None) -> float | None:
        return self.number(flag, float, default)

    def refuse(self, flag: str, why: str) -> None:
        self.issues.append((flag, why))


class Native:
    """The native config dict being built, and the log line of each value written."""

    def __init__(
        self, flags: Flags, say: Callable[[str], None], origins: dict[str, tuple[str, object]]
    ) -> None:
        self.data: dict[str, object] = {}
        self.flags = flags
        self.say = say
        self.origins = origins

    def to(self, path: str, value: object, flag: str, note: str = "") -> None:
        node = self.data
        parts = path.split(".")
        for part in parts[:-1]:
            node = cast("dict[str, object]", node.setdefault(part, {}))
        node[parts[-1]] = value
        given = self.flags.given.get(flag)
        self.origins[path] = (flag, given)
        extra = f" ({note})" if note else ""
        if flag not in self.flags.given:
            self.say(f"{flag} not given -> {path}: {value!r} (Megatron's default){extra}")
            return
        shown = "" if given is True else " " + (" ".join(given) if isinstance(given, list) else str(given))
        self.say(f"{flag}{shown} -> {path}: {value!r}{extra}")

    def get(self, path: str) -> object:
        node: object = self.data
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node
