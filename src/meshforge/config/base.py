"""Base classes and value types shared by every config section (light: pydantic only, no torch).

Why a layer over plain pydantic: the config is a user-facing contract, so its errors must name the
key path (`training.global_batch_size: must be positive, got 0`) and suggest the key the user
probably meant, and its numbers follow meshforge's rules rather than pydantic's lax defaults:
`"10"` and `1e-8` are numbers, a boolean never is, and a bool field takes only a real boolean.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

Issue = tuple[str, str]


class ConfigError(Exception):
    """A configuration that cannot be used, with one (key path, reason) pair per problem.

    `str()` gives one line per issue, `error: <key path>: <reason>`, ready to print without a
    traceback.
    """

    def __init__(self, issues: Iterable[Issue]):
        self.issues: list[Issue] = list(issues) or [("<config>", "invalid configuration")]
        super().__init__(self._text())

    def _text(self) -> str:
        return "\n".join(f"error: {path}: {reason}" for path, reason in self.issues)

    def __str__(self) -> str:
        return self._text()


# --- numbers and booleans ---------------------------------------------------------------------


def _reject_bool(value: object) -> object:
    if isinstance(value, bool):
        raise PydanticCustomError(
            "bool_not_number", "a boolean is not a number (got {value})", {"value": str(value).lower()}
        )
    return value


def _strip_numeric_string(value: object) -> object:
    value = _reject_bool(value)
    if isinstance(value, str):
        return value.strip()
    return value


Int = Annotated[int, BeforeValidator(_strip_numeric_string)]
"""An integer: accepts `10` and `"10"`, never a bool."""
Float = Annotated[float, BeforeValidator(_strip_numeric_string)]
"""A float: accepts `1e-8`, `"1e-8"` and ints, never a bool."""
Bool = StrictBool
"""A real YAML boolean only (`true`/`false`), never `1` or `"yes"`."""


def _positive(value: float) -> float:
    if value <= 0:
        raise ValueError(f"must be positive, got {value}")
    return value


def _non_negative(value: float) -> float:
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")
    return value


def _at_least_one(value: int) -> int:
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


PosInt = Annotated[Int, AfterValidator(_positive)]
PosFloat = Annotated[Float, AfterValidator(_positive)]
NonNegInt = Annotated[Int, AfterValidator(_non_negative)]
NonNegFloat = Annotated[Float, AfterValidator(_non_negative)]
AtLeastOne = Annotated[Int, AfterValidator(_at_least_one)]

# Every dtype key takes each of the six spellings users bring (torch's names, Megatron's and
# MindSpeed's short ones) and holds the torch name, so consumers compare one spelling.
DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def _dtype_name(value: object) -> object:
    if isinstance(value, str):
        key = value.strip().lower()
        if key not in DTYPE_ALIASES:
            raise ValueError(
                f"must be float32, bfloat16 or float16 (aliases fp32, bf16, fp16), got {value!r}"
            )
        return DTYPE_ALIASES[key]
    return value


DtypeName = Annotated[Literal["float32", "bfloat16", "float16"], BeforeValidator(_dtype_name)]


def describe(default: object, description: str, **kwargs: Any) -> Any:
    """A field with its default and the one-line description shown by `config schema`/`show`.

    Untyped like pydantic's `Field` (whose result it is), so `x: int = describe(1, ...)`
    type-checks; `kwargs` go to `Field` verbatim.
    """
    return Field(default, description=description, **kwargs)


def rule_error(field: str, message: str) -> PydanticCustomError:
    """An error of a cross-field rule inside one section, reported at `<section>.<field>`.

    pydantic reports a model validator's errors at the section's path; the `field` carried in
    the context lets `format_validation_error` append the key it is really about.
    """
    return PydanticCustomError("meshforge_rule", message, {"field": field})


# --- unknown keys ------------------------------------------------------------------------------


def suggest(key: str, choices: Iterable[str]) -> str | None:
    """The closest known key to a misspelt one, or None (difflib, cutoff 0.6)."""
    match = difflib.get_close_matches(str(key), list(choices), n=1, cutoff=0.6)
    return match[0] if match else None


def unknown_keys_message(section: str, unknown: list[str], known: Iterable[str]) -> str:
    """`Unknown configuration keys for <section>: [...]` plus did-you-mean hints."""
    known = list(known)
    hints = []
    for key in unknown:
        guess = suggest(key, known)
        if guess:
            hints.append(f"{key!r} -> did you mean {guess!r}?")
    text = f"Unknown configuration keys for {section}: {unknown}"
    if hints:
        text += " (" + "; ".join(hints) + ")"
    else:
        text += f"; known keys: {sorted(known)}"
    return text


class _Section(BaseModel):
    """Common mechanics: frozen after validation, mapping input required."""

    model_config = ConfigDict(frozen=True, validate_default=False, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _require_mapping(cls, data: object) -> object:
        if isinstance(data, BaseModel):
            return data
        if not isinstance(data, dict):
            raise PydanticCustomError(
                "not_a_mapping",
                "must be a mapping of keys to values, got {kind}",
                {"kind": type(data).__name__ if data is not None else "null"},
            )
        return data


class StrictSection(_Section):
    """A section that rejects keys it does not declare, naming the closest known key."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown(cls, data: object) -> object:
        if isinstance(data, dict):
            known = set(cls.model_fields)
            unknown = [str(k) for k in data if k not in known]
            if unknown:
                raise PydanticCustomError(
                    "unknown_keys",
                    "{message}",
                    {"message": unknown_keys_message("{section}", unknown, known), "unknown": unknown},
                )
        return data


class PassthroughSection(_Section):
    """A section that keeps undeclared keys (`section.model_extra`) for the component it configures.

    The component declares what it accepts (e.g. the model family's hyper-parameters); the config
    system asks it at `check_trainable` and `config validate` so a typo does not pass silently.
    """

    model_config = ConfigDict(frozen=True, extra="allow", populate_by_name=True)

    @property
    def extra(self) -> dict[str, object]:
        """The undeclared (passthrough) keys, as written in the YAML."""
        return dict(self.model_extra or {})


# --- error formatting -------------------------------------------------------------------------


def key_path(loc: Iterable[int | str], prefix: str = "") -> str:
    """Turn a pydantic location `('callbacks', 0, 'type')` into `callbacks[0].type`."""
    text = prefix
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part in ("function-after[", "function-before["):
            continue
        else:
            text += ("." if text else "") + str(part)
    return text


_UNION_TAGS = ("function-", "list[", "dict[", "union[", "tagged-union[", "nullable[", "lax-or-strict[")


def _clean_loc(loc: tuple[int | str, ...]) -> list[int | str]:
    """Drop pydantic's internal tags (`int`, `literal['auto']`, `function-after[...]`): they are not keys."""
    out: list[int | str] = []
    for part in loc:
        if isinstance(part, str) and (
            part.startswith(_UNION_TAGS) or "[" in part or part in ("int", "str", "float", "bool", "none")
        ):
            continue
        out.append(part)
    return out


def format_validation_error(err: ValidationError, prefix: str = "") -> list[Issue]:
    """Convert a pydantic ValidationError into (key path, reason) issues, one per distinct path."""
    issues: list[Issue] = []
    seen: dict[str, int] = {}
    merged: dict[str, list[str]] = {}
    for item in err.errors(include_url=False):
        loc = _clean_loc(tuple(item.get("loc", ())))
        ctx = item.get("ctx") or {}
        kind = item.get("type", "")
        msg = item.get("msg", "invalid value")
        if kind == "meshforge_rule" and ctx.get("field"):
            loc = [*loc, *str(ctx["field"]).split(".")]
        path = key_path(loc, prefix) or "<top level>"
        if kind == "unknown_keys":
            section = key_path(loc, prefix) or "the top level"
            msg = str(ctx.get("message", msg)).replace("{section}", section)
            unknown = ctx.get("unknown") or []
            if len(unknown) == 1:
                path = key_path([*loc, unknown[0]], prefix)
        elif kind == "missing":
            msg = "required key is missing"
        elif item.get("input", "") is None and kind not in ("meshforge_rule", "value_error"):
            msg = f"cannot be null ({_lower_first(msg)})"
        elif kind == "value_error" and msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        elif kind == "assertion_error" and msg.startswith("Assertion failed, "):
            msg = msg[len("Assertion failed, ") :]
        elif kind == "bool_type":
            msg = f"must be true or false (got {item.get('input')!r})"
        elif kind not in (
            "meshforge_rule",
            "not_a_mapping",
            "bool_not_number",
            "layer_spec",
            "layer_spec_order",
        ):
            got = item.get("input", None)
            if not isinstance(got, dict | list) and kind != "extra_forbidden":
                msg = f"{msg} (got {got!r})"
        # Union members each report the same path: merge them into one "none of these forms" reason.
        if path in seen:
            merged[path].append(msg)
            continue
        seen[path] = len(issues)
        merged[path] = [msg]
        issues.append((path, msg))
    return [(path, _merge(merged[path])) for path, _ in issues]


def _merge(messages: list[str]) -> str:
    if len(messages) == 1:
        return messages[0]
    got = ""
    parts = []
    for msg in messages:
        head, sep, tail = msg.rpartition(" (got ")
        if sep:
            got = f" (got {tail}"
            msg = head
        msg = _lower_first(msg)
        if msg not in parts:
            parts.append(msg)
    return "matches none of the allowed forms: " + "; ".join(parts) + got


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:] if text else text
