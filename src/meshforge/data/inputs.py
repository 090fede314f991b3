"""The files a training config reads, checked for existence before anything is read.

`config validate` and the trainer's pre-flight check (`config.checks.check_trainable`) call
:func:`input_issues`, so a missing data file, model folder or dataset name is one error naming its
key path, the same from either command, before a process group, a tokenizer or a model exists.
Only names and paths are looked at (a folder listing, `dataset_info.json`): no file is opened
for its contents, so the check costs milliseconds on data of any size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from meshforge.utils.resources import resolve_path

if TYPE_CHECKING:
    from meshforge.config.root import TrainConfig
    from meshforge.data.config import TrainDatasetConfig

Issue = tuple[str, str]
_DATA_PATH = "train_dataset.dataloader.config.data_path"


def _split_issue(err: Exception, default_key: str) -> Issue:
    """`(key, reason)` of an error whose message starts with its key path (`key: reason`)."""
    text = str(err)
    head, sep, rest = text.partition(": ")
    if sep and (head.startswith("train_dataset") or head.endswith("dataset_info.json")):
        return head, rest
    return default_key, text


def _text_inputs(data: TrainDatasetConfig) -> list[Issue]:
    from meshforge.data.text import list_text_files
    from meshforge.data.text_specs import TextDataLoaderOptions

    options = data.dataloader.options
    if not isinstance(options, TextDataLoaderOptions):
        return []  # the options' own errors are reported by the options check
    try:
        list_text_files(list(options.data_path))
    except (FileNotFoundError, ValueError) as err:
        return [_split_issue(err, "train_dataset.dataloader.data_path")]
    return []


def _megatron_inputs(data: TrainDatasetConfig) -> list[Issue]:
    from meshforge.data.megatron.blended import parse_blend
    from meshforge.data.megatron.raw import is_prefix, raw_files
    from meshforge.data.megatron.specs import MegatronDataLoaderOptions

    options = data.dataloader.options
    if not isinstance(options, MegatronDataLoaderOptions):
        return []
    try:
        prefixes = parse_blend(list(options.config.data_path), _DATA_PATH).prefixes
    except ValueError as err:
        return [_split_issue(err, _DATA_PATH)]
    issues = []
    for entry in prefixes:
        path = resolve_path(entry)
        if not is_prefix(path) and raw_files(path) is None:
            issues.append(
                (
                    _DATA_PATH,
                    f"{entry!r} (resolved to {path}) is neither a Megatron prefix ({path}.bin and "
                    ".idx) nor a raw data file or folder (parquet, arrow, csv, json, jsonl, txt)",
                )
            )
    return issues


def _sft_inputs(data: TrainDatasetConfig) -> list[Issue]:
    from meshforge.data.sft.dataset_info import resolve_datasets

    if data.tokenized_path and resolve_path(data.tokenized_path).is_dir():
        return []  # the saved tokenized dataset is read instead of the named ones
    issues = []
    for key, named in (
        ("train_dataset.dataset", data.dataset),
        ("train_dataset.eval_dataset", data.eval_dataset),
    ):
        if named is None and key.endswith("eval_dataset"):
            continue
        try:
            resolve_datasets(named, data.dataset_dir)
        except (FileNotFoundError, ValueError) as err:
            issues.append(_split_issue(err, key))
    return issues


_LOADER_INPUTS: dict[str, Callable[[TrainDatasetConfig], list[Issue]]] = {
    "TextDataLoader": _text_inputs,
    "BlendedMegatronDatasetDataLoader": _megatron_inputs,
    "SFTDataLoader": _sft_inputs,
}


def _folder_issue(key: str, value: str | None, what: str) -> list[Issue]:
    if not value:
        return []
    path = resolve_path(value)
    if path.is_dir():
        return []
    return [
        (
            key,
            f"no such folder: {value!r} (resolved to {path}); give the local {what} folder (names on "
            "the Hugging Face hub are never downloaded)",
        )
    ]


def input_issues(cfg: TrainConfig) -> list[Issue]:
    """Every path of `cfg` that does not name what it should: model and tokenizer folders, the
    data the loader reads (files, Megatron prefixes, SFT dataset names and their files) and an
    explicit `checkpoint.load_path`."""
    model = cfg.model
    issues = _folder_issue("model.model_name_or_path", model.model_name_or_path, "Hugging Face model")
    if model.tokenizer_name_or_path != model.model_name_or_path:
        issues += _folder_issue("model.tokenizer_name_or_path", model.tokenizer_name_or_path, "tokenizer")
    check = _LOADER_INPUTS.get(cfg.train_dataset.dataloader.type or "")
    if check is not None:
        issues += check(cfg.train_dataset)
    load = cfg.checkpoint.load_path
    if load and load != "auto" and not resolve_path(load).exists():
        issues.append(
            (
                "checkpoint.load_path",
                f"no such folder: {load!r} (resolved to {resolve_path(load)}); give a step folder, a run's "
                "checkpoints folder, a Hugging Face folder, or auto",
            )
        )
    return issues


__all__ = ["input_issues"]
