"""Options of each data loader type, checkable without loading any data (LIGHT: no torch import).

`train_dataset.dataloader` is a passthrough section: besides its declared fields (`type`, `shuffle`,
`column_names`, `python_multiprocessing`) it carries the options of the loader named by `type`. The
config system calls `check_dataloader_options` so that a misspelt option (`seq_lenght`) is reported
with its key path at `config validate` / `train` time, long before any file is opened. Each built
loader declares its options as a pydantic model here; `data/build.py` builds the loader from them.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StringConstraints,
    ValidationError,
    field_validator,
)

from meshforge.data.megatron.specs import MegatronDataLoaderOptions
from meshforge.data.sft.specs import SFTDataLoaderOptions

# Keys declared by the config system's DataloaderConfig itself; if a caller passes the whole
# section instead of only its extras, they are not options of the loader and are skipped here.
DECLARED_DATALOADER_KEYS = frozenset({"type", "shuffle", "column_names", "python_multiprocessing"})

# Loader types other work items will build; named so the message says "not yet" rather than "unknown".
PLANNED_LOADERS: tuple[str, ...] = ()


class TextDataLoaderOptions(BaseModel):
    """Options of `TextDataLoader`: raw text files tokenized and packed into fixed-length samples."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data_path: list[Annotated[str, StringConstraints(min_length=1)]] = Field(
        description="Text data: a file (.jsonl, .json, .txt) or folder of them, or a list of those; "
        "meshforge:// names bundled files, other relative paths resolve against the working directory."
    )
    text_key: str = Field(default="text", min_length=1, description="JSON key that holds a document's text.")
    seq_length: int = Field(gt=0, description="Tokens per sample (model input length).")
    append_eod: StrictBool = Field(
        default=True, description="Append the end-of-document token after every document."
    )

    @field_validator("data_path", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        # A single path is the common case in YAML; keep one internal shape.
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list | tuple):
            if not value:
                raise ValueError("must name at least one file or folder")
        elif not isinstance(value, list | tuple):
            raise ValueError(f"must be a path or a list of paths, got {value!r}")
        return value

    @field_validator("seq_length", mode="before")
    @classmethod
    def _no_bool(cls, value: Any) -> Any:
        # pydantic would read `true` as 1; a bool is never a number in meshforge configs.
        if isinstance(value, bool):
            raise ValueError(f"must be a positive integer, got {value!r}")
        return value


# Built loader types and the model of their options (the builders live in data/build.py).
BUILT_LOADERS: dict[str, type[BaseModel]] = {
    "TextDataLoader": TextDataLoaderOptions,
    "BlendedMegatronDatasetDataLoader": MegatronDataLoaderOptions,
    "SFTDataLoader": SFTDataLoaderOptions,
}


def _key_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _owner(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel]:
    """The (possibly nested) options model that holds the last key of `loc`."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if isinstance(part, str) else None
        sub = getattr(field, "annotation", None) if field is not None else None
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            break
        model = sub
    return model


def _TRAIN_DATASET_FIELDS() -> set[str]:  # noqa: N802 (reads like the constant it stands for)
    from meshforge.data.config import TrainDatasetConfig

    return set(TrainDatasetConfig.model_fields)


def _issues_from(error: ValidationError, model: type[BaseModel]) -> list[tuple[str, str]]:
    issues = []
    for err in error.errors():
        key = _key_path(err["loc"])
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
                if name in _TRAIN_DATASET_FIELDS():
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


def check_dataloader_options(type_name: str | None, options: dict) -> list[tuple[str, str]]:
    """Check a loader's passthrough options without opening any file.

    Args:
        type_name: `train_dataset.dataloader.type`.
        options: the undeclared (passthrough) keys of `train_dataset.dataloader`.

    Returns:
        (key relative to `train_dataset.dataloader`, reason) for every problem; empty when valid.
    """
    built = ", ".join(BUILT_LOADERS)
    if type_name is None:
        return [("type", f"no data loader type given: set it to one of the built loaders: {built}")]
    if type_name not in BUILT_LOADERS:
        if type_name in PLANNED_LOADERS:
            return [("type", f"not supported yet: {type_name}; built loaders: {built}")]
        close = difflib.get_close_matches(type_name, [*BUILT_LOADERS, *PLANNED_LOADERS], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return [("type", f"not supported yet: unknown loader {type_name!r}{hint}; built loaders: {built}")]
    model = BUILT_LOADERS[type_name]
    own = {k: v for k, v in options.items() if k not in DECLARED_DATALOADER_KEYS}
    try:
        model.model_validate(own)
    except ValidationError as exc:
        return _issues_from(exc, model)
    return []


def parse_text_options(options: dict) -> TextDataLoaderOptions:
    """Validate `TextDataLoader` options, raising one ValueError that lists every problem.

    Raises:
        ValueError: `train_dataset.dataloader.<key>: <reason>` lines.
    """
    issues = check_dataloader_options("TextDataLoader", options)
    if issues:
        raise ValueError("\n".join(f"train_dataset.dataloader.{key}: {reason}" for key, reason in issues))
    own = {k: v for k, v in options.items() if k not in DECLARED_DATALOADER_KEYS}
    return TextDataLoaderOptions.model_validate(own)


def parse_megatron_options(options: dict) -> MegatronDataLoaderOptions:
    """Validate `BlendedMegatronDatasetDataLoader` options, raising one ValueError listing every problem.

    Raises:
        ValueError: `train_dataset.dataloader.<key>: <reason>` lines.
    """
    issues = check_dataloader_options("BlendedMegatronDatasetDataLoader", options)
    if issues:
        raise ValueError("\n".join(f"train_dataset.dataloader.{key}: {reason}" for key, reason in issues))
    own = {k: v for k, v in options.items() if k not in DECLARED_DATALOADER_KEYS}
    return MegatronDataLoaderOptions.model_validate(own)
