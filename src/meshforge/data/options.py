"""The base of every loader's options model, and how its validation errors are reported (LIGHT).

`train_dataset.dataloader` is a passthrough section: besides its declared fields (`type`,
`shuffle`, `column_names`, `python_multiprocessing`) it carries the options of the loader named by
`type`. Each loader declares them once as a `LoaderOptions` model beside its builder (its
docstring names the builder); `data/specs.py` registers model and builders under the type name,
and `DataloaderConfig` parses the options with that model once, when the config is validated.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo

if TYPE_CHECKING:
    from meshforge.data.config import TrainDatasetConfig

Issue = tuple[str, str]


class LoaderOptions(BaseModel):
    """Options of one loader type; unknown keys are refused (a typo is an error, never ignored)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def sequence(self, data: TrainDatasetConfig) -> tuple[int, str]:
        """(tokens per sample, the key path that sets it) for this loader's data."""
        raise NotImplementedError(f"{type(self).__name__} does not say where its sequence length is")


def key_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _owner(model: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel]:
    """The (possibly nested) options model that holds the last key of `loc`."""
    for part in loc[:-1]:
        field: FieldInfo | None = model.model_fields.get(part) if isinstance(part, str) else None
        sub = field.annotation if field is not None else None
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            break
        model = sub
    return model


def issues_from(
    error: ValidationError, model: type[BaseModel], *, section_fields: Collection[str] = ()
) -> list[Issue]:
    """(key relative to `train_dataset.dataloader`, reason) for every error of `model`'s validation.

    Unknown keys come first: a misspelt key is usually why a required one is reported missing.
    `section_fields` are the `train_dataset` field names, so that a loader setting written under
    `dataloader:` by mistake is pointed to its place.
    """
    issues = []
    errors = sorted(error.errors(), key=lambda err: err["type"] != "extra_forbidden")
    for err in errors:
        key = key_path(err["loc"])
        owner = _owner(model, err["loc"])
        valid = sorted(owner.model_fields)
        name = str(err["loc"][-1]) if err["loc"] else ""
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            if valid:
                reason = f"unknown option for this loader{hint} (valid: {', '.join(valid)})"
            else:
                # SFTDataLoader reads its options from the train_dataset fields themselves.
                reason = "this loader takes no options here; its settings are train_dataset fields"
                if name in section_fields:
                    reason += f" (move it to train_dataset.{name})"
        elif err["type"] == "missing":
            field = owner.model_fields.get(name)
            reason = f"required: {field.description if field is not None else name}"
        else:
            reason = err["msg"].removeprefix("Value error, ")
            if "input" in err and err["type"] != "value_error" and "got" not in reason:
                reason += f", got {err['input']!r}"
        issues.append((key, reason))
    return issues
