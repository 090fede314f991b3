"""Layer specs: `'0-3'`, `'5'` or a bare `5`, as used by recompute, swap and LoRA layer lists.

A spec names an inclusive range of decoder layers. A list of specs means their union and must be
strictly ascending and non-overlapping (each range starts after the previous one ends), exactly as
the MindFormers parser requires. Ranges are checked against the model's layer count only when it
is known (`check_layer_specs`), since the config can be validated without the model.
"""

from __future__ import annotations

import re
from typing import Annotated, NamedTuple

from pydantic import AfterValidator, BeforeValidator, PlainSerializer, WithJsonSchema
from pydantic_core import PydanticCustomError

_SPEC = re.compile(r"^(\d+)(?:-(\d+))?$")


class LayerRange(NamedTuple):
    """An inclusive range of layer indices, written `'lo-hi'` or `'lo'`."""

    lo: int
    hi: int

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}"

    def layers(self) -> range:
        """The layer indices covered by this range."""
        return range(self.lo, self.hi + 1)


def parse_layer_spec(value: object) -> LayerRange:
    """Parse `'0-3'`, `'5'` or `5` into a LayerRange.

    Raises:
        PydanticCustomError: for anything else, a bool, or `lo > hi`.
    """
    if isinstance(value, LayerRange):
        return value
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise PydanticCustomError(
            "layer_spec",
            "layer spec must be a string like '0-3' or '5' or an int, got {got}",
            {"got": repr(value)},
        )
    match = _SPEC.match(str(value).strip())
    if not match:
        raise PydanticCustomError(
            "layer_spec",
            "invalid layer spec {got}: write 'lo-hi' (inclusive) or a single layer number, quoted in YAML",
            {"got": repr(value)},
        )
    lo = int(match.group(1))
    hi = int(match.group(2)) if match.group(2) is not None else lo
    if lo > hi:
        raise PydanticCustomError(
            "layer_spec",
            "invalid layer spec {got}: start {lo} is greater than end {hi}",
            {"got": repr(value), "lo": lo, "hi": hi},
        )
    return LayerRange(lo, hi)


def _ascending(specs: list[LayerRange]) -> list[LayerRange]:
    for prev, cur in zip(specs, specs[1:]):
        if cur.lo <= prev.hi:
            raise PydanticCustomError(
                "layer_spec_order",
                "layer specs must be strictly ascending and non-overlapping: '{cur}' starts at or before the end of '{prev}'",
                {"cur": str(cur), "prev": str(prev)},
            )
    return specs


_SPEC_SCHEMA = {
    "anyOf": [{"type": "string", "pattern": r"^\s*\d+(-\d+)?\s*$"}, {"type": "integer", "minimum": 0}],
    "description": "Layer spec: 'lo-hi' (inclusive) or a single layer number.",
}

LayerSpec = Annotated[
    LayerRange,
    BeforeValidator(parse_layer_spec),
    PlainSerializer(str, return_type=str),
    WithJsonSchema(_SPEC_SCHEMA),
]
"""One layer spec; dumps back to its string form."""

LayerSpecList = Annotated[list[LayerSpec], AfterValidator(_ascending)]
"""An ascending, non-overlapping list of layer specs."""


def expand_layers(specs: list[LayerRange] | None) -> list[int]:
    """All layer indices covered by `specs`, ascending."""
    out: list[int] = []
    for spec in specs or []:
        out.extend(spec.layers())
    return out


def check_layer_specs(specs: list[LayerRange] | None, num_layers: int, path: str) -> list[tuple[str, str]]:
    """(key path, reason) for every spec whose end is not below `num_layers`."""
    issues = []
    for i, spec in enumerate(specs or []):
        if spec.hi >= num_layers:
            issues.append(
                (
                    f"{path}[{i}]",
                    f"layer spec '{spec}' is out of range [0, {num_layers - 1}] (the model has {num_layers} layers)",
                )
            )
    return issues
