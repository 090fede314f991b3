"""The one loader registry: per `train_dataset.dataloader.type`, its options model and builders (LIGHT).

Each entry pairs the options model (declared beside its builder, torch-free, so the config system
validates with it) with the train builder and, where the loader has validation data, the eval
builder. Builders are small functions that import their module on call, so importing this registry
(the config system does) never loads torch or the data libraries.

    type                              options                        builders
    TextDataLoader                    data/text_specs.py             data/text.py
    BlendedMegatronDatasetDataLoader  data/megatron/specs.py         data/megatron/loader.py
    SFTDataLoader                     data/sft/specs.py              data/sft/loader.py

`DataloaderConfig` has the options parsed once when the config is validated (by
`parse_section_options`, handed to it when this module is imported) and keeps them typed; a
config fragment whose options do not parse yet (a reference example without `data_path`) still
loads, its problems are what `check_dataloader_options` reports (warnings in `config validate`,
errors in `train`), and only its sequence length is read (with the `sequence` model), where a bad
value is an error when the config loads.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ValidationError

from meshforge.config.base import rule_error
from meshforge.data.config import ParsedOptions, TrainDatasetConfig, use_options_parser
from meshforge.data.megatron.specs import MegatronDataLoaderOptions, MegatronSequenceOptions
from meshforge.data.options import Issue, LoaderOptions, issues_from
from meshforge.data.sft.specs import SFTDataLoaderOptions, SFTSequenceOptions
from meshforge.data.text_specs import TextDataLoaderOptions, TextSequenceOptions

if TYPE_CHECKING:
    from meshforge.data.context import LoaderContext
    from meshforge.data.loader import EvalLoader, StatefulLoader, StreamLoader

    TrainLoader = StatefulLoader | StreamLoader

# Keys declared by the config system's DataloaderConfig itself; if a caller passes the whole
# section instead of only its extras, they are not options of the loader and are skipped here.
DECLARED_DATALOADER_KEYS = frozenset({"type", "shuffle", "column_names", "python_multiprocessing"})

# Loader types named so that the message says "not yet" rather than "unknown" (none at present).
PLANNED_LOADERS: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoaderKind:
    """One `dataloader.type`: how its options are parsed and how its loaders are built.

    Attributes:
        options: the options model of the passthrough keys.
        sequence: the part of `options` that holds the sequence length (a base class of it that
            ignores other keys), read from a config fragment whose other options do not parse.
        train: builds this rank's training loader.
        eval: builds the evaluation loader (None when there is no validation data), or None for a
            loader type that never has validation data.
        eval_each: builds the named evaluation loaders (`MIXED_EVAL` for one validation set, else
            one per evaluation dataset), for a loader type that can split its validation data by
            dataset; None = the one loader of `eval`.
        column_aware: the builder reads `dataloader.column_names` itself (else a non-default value
            is reported as without effect).
    """

    options: type[LoaderOptions]
    sequence: type[LoaderOptions]
    train: Callable[[TrainDatasetConfig, LoaderContext], TrainLoader]
    eval: Callable[[TrainDatasetConfig, LoaderContext], EvalLoader | None] | None = None
    column_aware: bool = False
    eval_each: Callable[[TrainDatasetConfig, LoaderContext], dict[str, EvalLoader]] | None = None


def _text_train(data: TrainDatasetConfig, ctx: LoaderContext) -> TrainLoader:
    from meshforge.data.text import build_text_loader

    return build_text_loader(data, ctx)


def _megatron_train(data: TrainDatasetConfig, ctx: LoaderContext) -> TrainLoader:
    from meshforge.data.megatron.loader import build_megatron_loader

    return build_megatron_loader(data, ctx)


def _megatron_eval(data: TrainDatasetConfig, ctx: LoaderContext) -> EvalLoader | None:
    from meshforge.data.megatron.loader import build_megatron_eval_loader

    return build_megatron_eval_loader(data, ctx)


def _sft_train(data: TrainDatasetConfig, ctx: LoaderContext) -> TrainLoader:
    from meshforge.data.sft.loader import build_sft_loader

    return build_sft_loader(data, ctx)


def _sft_eval(data: TrainDatasetConfig, ctx: LoaderContext) -> EvalLoader | None:
    from meshforge.data.sft.loader import build_sft_eval_loader

    return build_sft_eval_loader(data, ctx)


def _sft_eval_each(data: TrainDatasetConfig, ctx: LoaderContext) -> dict[str, EvalLoader]:
    from meshforge.data.sft.loader import build_sft_eval_loaders

    return build_sft_eval_loaders(data, ctx)


LOADERS: dict[str, LoaderKind] = {
    "TextDataLoader": LoaderKind(TextDataLoaderOptions, TextSequenceOptions, _text_train),
    "BlendedMegatronDatasetDataLoader": LoaderKind(
        MegatronDataLoaderOptions, MegatronSequenceOptions, _megatron_train, _megatron_eval, column_aware=True
    ),
    "SFTDataLoader": LoaderKind(
        SFTDataLoaderOptions, SFTSequenceOptions, _sft_train, _sft_eval, eval_each=_sft_eval_each
    ),
}


def register_loader(type_name: str, kind: LoaderKind) -> None:
    """Make `train_dataset.dataloader.type: <type_name>` parse and build with `kind`."""
    LOADERS[type_name] = kind


def _type_issue(type_name: str | None) -> Issue:
    built = ", ".join(LOADERS)
    if type_name is None:
        return ("type", f"no data loader type given: set it to one of the built loaders: {built}")
    if type_name in PLANNED_LOADERS:
        return ("type", f"not supported yet: {type_name}; built loaders: {built}")
    close = difflib.get_close_matches(type_name, [*LOADERS, *PLANNED_LOADERS], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ("type", f"not supported yet: unknown loader {type_name!r}{hint}; built loaders: {built}")


def _parse(
    kind: LoaderKind, options: Mapping[str, object], section_fields: Collection[str]
) -> LoaderOptions | list[Issue]:
    """The parsed options, or the (key, reason) problems that stop them parsing."""
    own = {k: v for k, v in options.items() if k not in DECLARED_DATALOADER_KEYS}
    try:
        return kind.options.model_validate(own)
    except ValidationError as exc:
        return issues_from(exc, kind.options, section_fields=section_fields)


def check_dataloader_options(
    type_name: str | None, options: Mapping[str, object], *, section_fields: Collection[str] = ()
) -> list[Issue]:
    """Check a loader's passthrough options without opening any file.

    Args:
        type_name: `train_dataset.dataloader.type`.
        options: the undeclared (passthrough) keys of `train_dataset.dataloader`.
        section_fields: the `train_dataset` field names (a setting written under `dataloader:`
            by mistake is pointed to its place).

    Returns:
        (key relative to `train_dataset.dataloader`, reason) for every problem; empty when valid.
    """
    parsed = options_or_issues(type_name, options, section_fields=section_fields)
    return parsed if isinstance(parsed, list) else []


def options_or_issues(
    type_name: str | None, options: Mapping[str, object], *, section_fields: Collection[str] = ()
) -> LoaderOptions | list[Issue]:
    """The typed options of loader `type_name`, or every problem as (key, reason) pairs."""
    kind = LOADERS.get(type_name) if type_name is not None else None
    if kind is None:
        return [_type_issue(type_name)]
    return _parse(kind, options, section_fields)


def sequence_or_issues(kind: LoaderKind, options: Mapping[str, object]) -> LoaderOptions | list[Issue] | None:
    """The sequence part of the options (`kind.sequence`), its problems, or None when it is absent."""
    own = {k: v for k, v in options.items() if k not in DECLARED_DATALOADER_KEYS}
    try:
        return kind.sequence.model_validate(own)
    except ValidationError as exc:
        if all(err["type"] == "missing" for err in exc.errors()):
            return None
        return [issue for issue in issues_from(exc, kind.sequence) if not issue[1].startswith("required")]


def parse_dataloader_options(type_name: str | None, options: Mapping[str, object]) -> LoaderOptions:
    """The typed options of loader `type_name`, raising one ValueError that lists every problem.

    Raises:
        ValueError: `train_dataset.dataloader.<key>: <reason>` lines.
    """
    parsed = options_or_issues(type_name, options)
    if isinstance(parsed, list):
        raise ValueError("\n".join(f"train_dataset.dataloader.{key}: {reason}" for key, reason in parsed))
    return parsed


def parse_section_options(type_name: str | None, options: Mapping[str, object]) -> ParsedOptions:
    """Read the passthrough keys of one `train_dataset.dataloader` section (at its validation).

    A config fragment whose options do not parse (a reference example without data_path) still
    loads: its problems are returned as issues (warnings in `config validate`, errors in `train`),
    and only the sequence length is read, where a bad value is an error now. A type that names no
    built loader is an issue too ("not supported yet").

    Raises:
        PydanticCustomError: the sequence length of a built loader is invalid (at its key path).
    """
    parsed = options_or_issues(type_name, options, section_fields=TrainDatasetConfig.model_fields)
    if not isinstance(parsed, list):
        return ParsedOptions(parsed, parsed)
    kind = LOADERS.get(type_name) if type_name is not None else None
    if kind is None:
        return ParsedOptions(None, None, tuple(parsed))
    sequence = sequence_or_issues(kind, options)
    if isinstance(sequence, list):
        (key, reason), *more = sequence
        also = "".join(f"; also train_dataset.dataloader.{k}: {r}" for k, r in more)
        raise rule_error(key, reason + also)
    return ParsedOptions(None, sequence, tuple(parsed))


use_options_parser(parse_section_options)
