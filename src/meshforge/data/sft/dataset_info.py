"""Resolve `train_dataset.dataset` into LLaMA-Factory `DatasetAttr`s and load their files.

A dataset is either a name looked up in `{dataset_dir}/dataset_info.json`, or an inline dict with
the same keys (`file_name`, `formatting`, `columns`, `tags`, ...). The column and tag defaults, and
the rule that a given `columns` / `tags` object replaces the defaults instead of merging with them
(every key it omits becomes None), follow LLaMA-Factory's `DatasetAttr` exactly (LLaMA-Factory's `data/parser.py`), so a
`dataset_info.json` written for LLaMA-Factory means the same thing here. Hub, script and cloud
sources are refused: meshforge never downloads data during a run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from meshforge.utils.resources import resolve_path

if TYPE_CHECKING:
    from meshforge.data.sft.arrow import ArrowDataset

COLUMN_DEFAULTS: dict[str, str | None] = {
    "prompt": "instruction",
    "query": "input",
    "response": "output",
    "history": None,
    "messages": "conversations",
    "system": None,
    "tools": None,
    "images": None,
    "videos": None,
    "audios": None,
    "chosen": None,
    "rejected": None,
    "kto_tag": None,
}
TAG_DEFAULTS: dict[str, str | None] = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
# OpenAI-style `messages` files: the same converter as sharegpt with OpenAI's key names.
OPENAI_DEFAULTS: dict[str, str | None] = {
    "role_tag": "role",
    "content_tag": "content",
    "user_tag": "user",
    "assistant_tag": "assistant",
    "observation_tag": "tool",
    "function_tag": "function",
    "system_tag": "system",
}
FORMATTINGS = ("alpaca", "sharegpt", "openai")
# File extension -> `datasets` builder name (jsonl is read by the json builder, as in LLaMA-Factory).
FILE_TYPES = {
    "arrow": "arrow",
    "csv": "csv",
    "json": "json",
    "jsonl": "json",
    "parquet": "parquet",
    "txt": "text",
}
REMOTE_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")


@dataclass
class DatasetAttr:
    """One dataset: where its files are and how its columns map to conversations."""

    name: str
    files: list[Path]
    file_type: str
    formatting: str = "alpaca"
    ranking: bool = False
    split: str = "train"
    num_samples: int | None = None
    columns: dict[str, str | None] = field(default_factory=lambda: dict(COLUMN_DEFAULTS))
    tags: dict[str, str | None] = field(default_factory=lambda: dict(TAG_DEFAULTS))


def dataset_entries(dataset: object) -> list[tuple[str, object]]:
    """(key path, name or inline dict) for each dataset `train_dataset.dataset` names."""
    if dataset is None:
        return []
    if isinstance(dataset, dict):
        return [("train_dataset.dataset", dataset)]
    if isinstance(dataset, list):
        return [(f"train_dataset.dataset[{i}]", item) for i, item in enumerate(dataset)]
    names = [name.strip() for name in str(dataset).split(",") if name.strip()]
    return [(f"train_dataset.dataset[{i}]", name) for i, name in enumerate(names)]


def _read_info(dataset_dir: Path) -> dict[str, object]:
    path = dataset_dir / "dataset_info.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"train_dataset.dataset_dir: no dataset_info.json in {dataset_dir}; give dataset names "
            "listed there, or an inline dataset dict with file_name"
        )
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8 JSON") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(info, dict):
        raise ValueError(f"{path}: must hold an object of dataset names")
    return info


def _mapping(
    info: dict[str, object], key: str, defaults: dict[str, str | None], where: str
) -> dict[str, str | None]:
    if key not in info:
        return dict(defaults)
    given = info[key]
    if not isinstance(given, dict):
        raise ValueError(f"{where}.{key}: must be an object, got {type(given).__name__}")
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"{where}.{key}: unknown key(s) {unknown} (valid: {', '.join(defaults)})")
    # LLaMA-Factory's rule: a given object does not merge with the defaults.
    return {name: given.get(name) for name in defaults}


def _files(file_name: str, base: Path, where: str) -> tuple[list[Path], str]:
    # As in LLaMA-Factory, a relative file_name is relative to dataset_dir (inline datasets too).
    if file_name.startswith("meshforge://"):
        path = resolve_path(file_name)
    else:
        path = Path(file_name).expanduser()
        path = path if path.is_absolute() else base / path
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"{where}.file_name: no such file or folder: {path}")
    if not files:
        raise FileNotFoundError(f"{where}.file_name: folder {path} holds no file")
    types: set[str] = set()
    for file in files:
        kind = FILE_TYPES.get(file.suffix.lstrip(".").lower())
        if kind is None:
            raise ValueError(
                f"{where}.file_name: {file} has an unsupported type (valid: {', '.join(FILE_TYPES)})"
            )
        types.add(kind)
    if len(types) > 1:
        raise ValueError(f"{where}.file_name: files in {path} must share one type, found {sorted(types)}")
    return files, types.pop()


def resolve_datasets(dataset: object, dataset_dir: str, *, ranking: bool | None = None) -> list[DatasetAttr]:
    """The `DatasetAttr` of every dataset `train_dataset.dataset` names.

    `ranking`: True for preference training (every dataset must be `ranking: true`), False for
    SFT (none may be), None to accept either.

    Raises:
        FileNotFoundError / ValueError: naming the key path (or dataset_info.json entry) at fault.
    """
    entries = dataset_entries(dataset)
    if not entries:
        raise ValueError("train_dataset.dataset: SFTDataLoader needs at least one dataset (a name or dict)")
    base = resolve_path(dataset_dir)
    info_file: dict[str, object] | None = None
    attrs = []
    for where, item in entries:
        info: object
        if isinstance(item, dict):
            name, info = where, item
        else:
            if info_file is None:
                info_file = _read_info(base)
            if item not in info_file:
                known = ", ".join(sorted(info_file)) or "none"
                raise ValueError(f"{where}: {item!r} is not in {base / 'dataset_info.json'} (known: {known})")
            name = str(item)  # `item` is one of the file's (str) keys
            info = info_file[name]
            where = f"{base / 'dataset_info.json'}: {item}"
        attr = _attr(name, info, base, where)
        if ranking is not None and attr.ranking != ranking:
            raise ValueError(
                f"{where}.ranking: "
                + (
                    "a pairwise (ranking: true) dataset trains only with training.stage: dpo or rm"
                    if attr.ranking
                    else "training.stage: dpo and rm need pairwise data: a dataset with ranking: true "
                    "and chosen/rejected columns"
                )
            )
        attrs.append(attr)
    return attrs


def _attr(name: str, info: object, base: Path, where: str) -> DatasetAttr:
    if not isinstance(info, dict):
        raise ValueError(f"{where}: a dataset must be an object with file_name, got {type(info).__name__}")
    remote = [key for key in REMOTE_KEYS if info.get(key)]
    if remote:
        raise ValueError(f"{where}.{remote[0]}: remote datasets are not downloaded; give a local file_name")
    if not info.get("file_name"):
        raise ValueError(f"{where}: needs file_name (a local file or folder)")
    formatting = info.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        raise ValueError(f"{where}.formatting: {formatting!r} is not one of {', '.join(FORMATTINGS)}")
    files, file_type = _files(str(info["file_name"]), base, where)
    tag_defaults = OPENAI_DEFAULTS if formatting == "openai" else TAG_DEFAULTS
    columns = _mapping(info, "columns", COLUMN_DEFAULTS, where)
    if formatting == "openai" and "columns" not in info:
        columns["messages"] = "messages"
    ranking = bool(info.get("ranking", False))
    media = [key for key in ("images", "videos", "audios", "kto_tag") if columns.get(key)]
    if media:
        raise ValueError(
            f"{where}.columns.{media[0]}: multimodal and KTO columns are not supported (text only)"
        )
    pair_columns = [key for key in ("chosen", "rejected") if columns.get(key)]
    if ranking and len(pair_columns) != 2:
        raise ValueError(f"{where}.columns: a ranking dataset needs both `chosen` and `rejected` columns")
    if pair_columns and not ranking:
        raise ValueError(f"{where}.columns.{pair_columns[0]}: preference columns need ranking: true")
    num_samples = info.get("num_samples")
    if num_samples is not None and (
        isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0
    ):
        raise ValueError(f"{where}.num_samples: must be a positive integer, got {num_samples!r}")
    return DatasetAttr(
        name=name,
        files=files,
        file_type=file_type,
        formatting=formatting,
        ranking=ranking,
        split=str(info.get("split", "train")),
        num_samples=num_samples,
        columns=columns,
        tags=_mapping(info, "tags", tag_defaults, where),
    )


def load_raw(attr: DatasetAttr, *, cache_dir: str | None = None) -> ArrowDataset:
    """The attr's files as a `datasets.Dataset` (split `attr.split`)."""
    import datasets

    return datasets.load_dataset(
        attr.file_type, data_files=[str(p) for p in attr.files], split=attr.split, cache_dir=cache_dir
    )
