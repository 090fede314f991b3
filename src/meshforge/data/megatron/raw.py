"""Raw pretraining files in a Megatron blend: converted once to `.bin/.idx`, then read as prefixes.

MindSpeed-LLM's documented way to pretrain is to give the raw dataset (`dataset: {file_name:
./train.parquet}`); its mg data manager tokenizes it into `.bin/.idx` on one rank and trains on
the result. Here an entry of `train_dataset.dataloader.config.data_path` may likewise be a raw file
(parquet, arrow, csv, json, jsonl, txt), a folder of them, or (through the importer) a comma list:

- rank 0 converts it with `meshforge preprocess`'s code (the `text` field of each record, the run's
  tokenizer, `append_eod`, `preprocessing_num_workers` processes), showing its progress; the other
  ranks wait for the result (a broadcast of the prefixes, which is also the barrier);
- the output goes next to the data (beside the file or the folder) or under `tokenized_path`, named
  `{name}-{key}_text_document.bin/.idx`, where `key` hashes the files' bytes and every setting that
  changes the tokens (tokenizer, EOD, format version). A later run with the same data and settings
  finds it and reuses it; `overwrite_cache: true` converts again. A different tokenizer or
  `append_eod` gives another key, so a stale conversion is never read;
- files are written under a temporary name and renamed when complete, so an interrupted conversion
  leaves nothing that a later run would take for finished.

Prefixes (`{p}.bin` and `{p}.idx` exist) pass through unchanged, weights of a blend are kept, and
the converted prefixes then train exactly as preprocessed data does. Several nodes need a shared
file system for the data folder (rank 0 writes, every rank reads), as for Megatron's index cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from meshforge.data.megatron.preprocess import SUFFIXES, PreprocessError, PreprocessOptions, output_prefix
from meshforge.utils.resources import resolve_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.data.megatron.specs import MegatronDataLoaderOptions

FORMAT_VERSION = 1  # bump when the conversion's output for the same input changes
JSON_KEY = "text"  # the field MindSpeed's mg manager tokenizes (--json-keys text)
KEY = "train_dataset.dataloader.config.data_path"
Log = Callable[[str], None]


def is_prefix(path: Path) -> bool:
    """Whether `path` names preprocessed data (`path.bin` and `path.idx` exist)."""
    return Path(f"{path}.bin").is_file() and Path(f"{path}.idx").is_file()


def raw_files(path: Path) -> list[Path] | None:
    """The raw files `path` names (a file, or a folder's raw files, sorted), or None if it names none."""
    if path.is_file():
        return [path] if path.suffix in SUFFIXES else None
    if path.is_dir():
        files = sorted(
            p
            for p in path.iterdir()
            if p.is_file() and p.suffix in SUFFIXES and not p.name.endswith(f"_{JSON_KEY}_document.json")
        )
        return files or None
    return None


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of everything in the tokenizer that decides the ids (its full definition when fast)."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode("utf-8"))
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode("utf-8"))
    digest.update(type(tokenizer).__name__.encode("utf-8"))
    digest.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode("utf-8"))
    return digest.hexdigest()


def cache_key(files: list[Path], tokenizer_hash: str, eod: int | None) -> str:
    """Hash of the files' names and bytes and the conversion settings (16 hex digits)."""
    digest = hashlib.sha256()
    digest.update(
        json.dumps({"v": FORMAT_VERSION, "key": JSON_KEY, "eod": eod, "tok": tokenizer_hash}).encode()
    )
    for file in files:
        digest.update(file.name.encode("utf-8") + b"\0")
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def _target(path: Path, files: list[Path], key: str, tokenized_path: str | None) -> Path:
    """The base prefix the conversion of `path` writes (without `_text_document`)."""
    name = path.name if path.is_dir() else path.stem
    folder = resolve_path(tokenized_path) if tokenized_path else path.parent
    return Path(folder) / f"{name}-{key}"


def _convert(
    files: list[Path],
    base: Path,
    tokenizer: PreTrainedTokenizerBase,
    eod: int | None,
    workers: int,
    source: str,
    log: Log,
) -> None:
    """Tokenize `files` into `{base}_text_document.bin/.idx` (written complete or not at all)."""
    from meshforge.data.megatron.preprocess import preprocess

    base.parent.mkdir(parents=True, exist_ok=True)
    final = Path(output_prefix(str(base), JSON_KEY))
    with tempfile.TemporaryDirectory(dir=base.parent, prefix=f".{base.name}.") as tmp:
        list_file = Path(tmp) / "inputs"
        list_file.mkdir()
        for i, file in enumerate(files):
            # One folder of links keeps `preprocess`'s input a single path in the files' order.
            os.symlink(file.resolve(), list_file / f"{i:06d}-{file.name}")
        tokenizer_dir = ""
        if workers > 1:
            tokenizer_dir = str(Path(tmp) / "tokenizer")
            tokenizer.save_pretrained(tokenizer_dir)
        prefix = str(Path(tmp) / "out")
        options = PreprocessOptions(
            input=str(list_file),
            output_prefix=prefix,
            tokenizer=tokenizer_dir,
            json_keys=[JSON_KEY],
            append_eod=eod is not None,
            workers=workers,
        )
        log(f"Megatron data: converting {source} ({len(files)} file(s)) -> {final}.bin/.idx")
        try:
            summary = preprocess(options, out=sys.stderr, tokenizer=tokenizer)
        except PreprocessError as exc:
            raise ValueError(f"{KEY}: {source}: {exc}".replace(str(list_file), source)) from None
        written = output_prefix(prefix, JSON_KEY)
        manifest = {
            "sources": [str(f.resolve()) for f in files],
            "append_eod": eod is not None,
            "eod": eod,
            "tokenizer": str(getattr(tokenizer, "name_or_path", "")),
            "documents": summary.documents,
            "tokens": summary.tokens.get(JSON_KEY, 0),
            "format_version": FORMAT_VERSION,
        }
        Path(f"{written}.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        # The .idx is what makes a prefix complete (`is_prefix`), so it is moved last.
        for ext in ("json", "bin", "idx"):
            os.replace(f"{written}.{ext}", f"{final}.{ext}")
        for line in summary.lines()[:1]:
            log(f"Megatron data: {line}")


def convert_raw_entries(
    data_path: list[str],
    tokenizer: PreTrainedTokenizerBase | None,
    *,
    append_eod: bool,
    overwrite_cache: bool,
    tokenized_path: str | None,
    workers: int,
    log: Log,
) -> list[str]:
    """The blend list with each raw entry replaced by its converted prefix (converting as needed).

    Runs on one process (rank 0). Raises ValueError naming the entry for a path that is neither
    a prefix nor raw data, and for raw data without a tokenizer.
    """
    from meshforge.data.megatron.blended import parse_blend

    blend = parse_blend(data_path, KEY)
    out: list[str] = []
    fingerprint: str | None = None
    for entry in blend.prefixes:
        path = resolve_path(entry)
        files = None if is_prefix(path) else raw_files(path)
        if files is None:
            out.append(str(path))
            continue
        if tokenizer is None:
            raise ValueError(
                f"{KEY}: {entry} is raw data, which needs a tokenizer to convert: set "
                "model.tokenizer_name_or_path (or model.model_name_or_path)"
            )
        eod = None
        if append_eod:
            from meshforge.data.megatron.preprocess import resolve_eod

            try:
                eod = resolve_eod(tokenizer, None)[0]
            except PreprocessError as exc:
                raise ValueError(f"train_dataset.dataloader.config.append_eod: {exc}") from None
        if fingerprint is None:
            fingerprint = tokenizer_fingerprint(tokenizer)
        key = cache_key(files, fingerprint, eod)
        base = _target(path, files, key, tokenized_path)
        final = Path(output_prefix(str(base), JSON_KEY))
        if is_prefix(final) and not overwrite_cache:
            log(
                f"Megatron data: {entry}: reusing {final}.bin/.idx (same files and settings; overwrite_cache rebuilds)"
            )
        else:
            _convert(files, base, tokenizer, eod, workers, entry, log)
        out.append(str(final))
    if blend.weights is None:
        return out
    return [item for pair in zip(map(str, blend.weights), out, strict=True) for item in pair]


def has_raw_entries(data_path: list[str]) -> bool:
    """Whether any entry of the blend list is raw data (not a prefix)."""
    from meshforge.data.megatron.blended import parse_blend

    for entry in parse_blend(data_path, KEY).prefixes:
        path = resolve_path(entry)
        if not is_prefix(path) and raw_files(path) is not None:
            return True
    return False


def prepare_data_path(
    options: MegatronDataLoaderOptions,
    tokenizer: PreTrainedTokenizerBase | None,
    *,
    log: Log | None = None,
    per_node: bool = False,
) -> MegatronDataLoaderOptions:
    """`options` with raw entries of `config.data_path` converted (rank 0) and shared to every rank.

    Every rank calls it; rank 0 converts while the others wait in the broadcast of the result. An
    error on rank 0 is raised on every rank, so no rank is left waiting. With `per_node`
    (`train_dataset.no_shared_storage`) the first rank of every node converts into its node's
    cache; the converted prefixes are the same paths on every node, so rank 0's answer serves all,
    and a failure on another node's converting rank is raised there.
    """
    import torch.distributed as dist

    from meshforge.data.prepare import preparer_rank

    cfg = options.config
    if not has_raw_entries(cfg.data_path):
        return options
    say = log or (lambda _line: None)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    converts = preparer_rank(per_node=per_node) == 0 if distributed else True
    result: tuple[str, list[str] | str] = ("ok", list(cfg.data_path))
    if converts:
        try:
            paths = convert_raw_entries(
                list(cfg.data_path),
                tokenizer,
                append_eod=cfg.append_eod,
                overwrite_cache=cfg.overwrite_cache,
                tokenized_path=cfg.tokenized_path,
                workers=cfg.preprocessing_num_workers or 1,
                log=say,
            )
            result = ("ok", paths)
        except ValueError as exc:
            result = ("error", str(exc))
        except OSError as exc:
            hint = "" if cfg.tokenized_path else " (set tokenized_path to a writable folder)"
            result = ("error", f"{KEY}: converting raw data failed: {exc}{hint}")
    own = result
    if distributed:
        box: list[object] = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]  # type: ignore[assignment]
    if rank != 0 and own[0] == "error":
        result = own
    status, value = result
    if status == "error":
        raise ValueError(str(value))
    assert isinstance(value, list)
    config = cfg.model_copy(update={"data_path": value})
    return options.model_copy(update={"config": config})
