"""Raw text -> one packed token stream -> fixed-length pretraining samples (the `TextDataLoader` data).

For the demo and for users who bring plain text: every document is tokenized with the run's fast
tokenizer (no special tokens added), followed by the end-of-document id, and all documents are
concatenated into one int32 stream held in memory. The stream is cut Megatron-style: sample i is
`stream[i*S : i*S + S + 1]` (S = seq_length), so consecutive samples share one token and every token
but the last is a training target exactly once; `input_ids = sample[:-1]`, `labels = sample[1:]`.
Documents are packed across sample boundaries and attend to each other, as in Megatron-LM's GPT
dataset with its default `reset_attention_mask=False`.

File formats (chosen to match what `datasets.load_dataset` reads for the same extensions):
- `.jsonl`: one JSON object per non-blank line, the document under `text_key`;
- `.json`: one JSON array of such objects;
- `.txt`: one document per non-empty line (the line without its newline).
A folder stands for every such file below it, in sorted path order (hidden names skipped). A
malformed record raises ValueError naming `file:line` (or `file: item i` for .json). Empty
documents are skipped and counted; nothing else is dropped without being reported in the summary.

Caching the token stream is not worth its invalidation rules here: the 2 MB demo corpus (490k tokens)
is read and tokenized in under a second on two CPU cores. Everything is held in memory on every rank;
for corpora beyond a few hundred MB, preprocess into Megatron indexed files instead.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from meshforge.data.text_specs import TextDataLoaderOptions
from meshforge.data.tokenizer import eod_token_id
from meshforge.utils.resources import resolve_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.data.config import TrainDatasetConfig
    from meshforge.data.context import LoaderContext
    from meshforge.data.loader import StatefulLoader

SUFFIXES = (".jsonl", ".json", ".txt")
TOKENIZE_BATCH = 1000  # documents per tokenizer call: large enough for the Rust batch path


@dataclass(frozen=True)
class TextSummary:
    """What was read and how it was cut; `line()` is the one log line a run prints."""

    files: int
    documents: int
    empty_documents: int
    tokens: int
    seq_length: int
    samples: int
    tail_tokens: int
    seconds: float

    def line(self) -> str:
        empty = f" ({self.empty_documents:,} empty skipped)" if self.empty_documents else ""
        return (
            f"text data: {self.files} file(s), {self.documents:,} documents{empty}, {self.tokens:,} tokens "
            f"-> {self.samples:,} samples of {self.seq_length} tokens (+1 shared); {self.tail_tokens:,} "
            f"tail tokens do not fill a sample and are not used; {self.seconds:.1f}s"
        )


def list_text_files(data_path: list[str]) -> list[Path]:
    """Expand configured paths into the data files they name, in a deterministic order.

    Raises:
        FileNotFoundError: a path does not exist, or a folder holds no data file.
        ValueError: a file has an unsupported extension.
    """
    files: list[Path] = []
    for i, entry in enumerate(data_path):
        key = f"train_dataset.dataloader.data_path[{i}]"
        path = resolve_path(entry)
        if path.is_dir():
            found = sorted(
                p
                for p in path.rglob("*")
                if p.is_file()
                and p.suffix in SUFFIXES
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not found:
                raise FileNotFoundError(f"{key}: folder {path} holds no {'/'.join(SUFFIXES)} file")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise ValueError(f"{key}: {path} is not a {', '.join(SUFFIXES)} file")
            files.append(path)
        else:
            raise FileNotFoundError(f"{key}: no such file or folder: {entry!r} (resolved to {path})")
    return files


def _jsonl_docs(path: Path, text_key: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})"
                ) from None
            yield _text_of(record, text_key, f"{path}:{lineno}")


def _json_docs(path: Path, text_key: str) -> Iterator[str]:
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(records, list):
        raise ValueError(
            f"{path}: a .json data file must hold a list of objects, got {type(records).__name__}"
        )
    for i, record in enumerate(records):
        yield _text_of(record, text_key, f"{path}: item {i}")


def _txt_docs(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8", newline="") as f:
        for line in f:
            text = line.rstrip("\r\n")
            if text:
                yield text


def _text_of(record: object, text_key: str, where: str) -> str:
    if not isinstance(record, dict):
        raise ValueError(
            f"{where}: expected a JSON object with key {text_key!r}, got {type(record).__name__}"
        )
    if text_key not in record:
        keys = ", ".join(sorted(map(str, record))[:8]) or "none"
        raise ValueError(
            f"{where}: no key {text_key!r} (keys: {keys}); set train_dataset.dataloader.text_key to the text key"
        )
    text = record[text_key]
    if not isinstance(text, str):
        raise ValueError(f"{where}: {text_key!r} must be a string, got {type(text).__name__}")
    return text


def read_documents(path: Path, text_key: str) -> Iterator[str]:
    """Yield the documents of one data file (see the module docstring for the formats)."""
    try:
        if path.suffix == ".jsonl":
            yield from _jsonl_docs(path, text_key)
        elif path.suffix == ".json":
            yield from _json_docs(path, text_key)
        else:
            yield from _txt_docs(path)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def tokenize_documents(
    docs: Iterator[str], tokenizer: PreTrainedTokenizerBase, *, eod_id: int | None
) -> tuple[np.ndarray, int, int]:
    """Tokenize documents in batches into one int32 stream, `eod_id` after each when given.

    Returns:
        (stream, documents, empty documents skipped).
    """
    parts: list[np.ndarray] = []
    num_docs = num_empty = 0
    batch: list[str] = []

    def flush() -> None:
        # verbose=False: documents longer than model_max_length are expected here (they are packed)
        encoded = tokenizer(batch, add_special_tokens=False, return_attention_mask=False, verbose=False)
        for ids in encoded["input_ids"]:
            parts.append(np.asarray(ids, dtype=np.int32))
            if eod_id is not None:
                parts.append(np.asarray([eod_id], dtype=np.int32))
        batch.clear()

    for text in docs:
        if not text:
            num_empty += 1
            continue
        num_docs += 1
        batch.append(text)
        if len(batch) >= TOKENIZE_BATCH:
            flush()
    if batch:
        flush()
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return stream, num_docs, num_empty


class TextDataset:
    """Fixed-length samples over a packed token stream (see the module docstring).

    Implements the sample-source interface the `StatefulLoader` reads: `len()` and
    `get_batch(indices) -> {"input_ids": [B, S], "labels": [B, S]}` (numpy int64).
    """

    def __init__(self, stream: np.ndarray, seq_length: int, summary: TextSummary | None = None):
        if seq_length <= 0:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        self.stream = np.ascontiguousarray(stream, dtype=np.int32)
        self.seq_length = seq_length
        # sample i needs tokens [i*S, i*S + S] inclusive, so n samples need n*S + 1 tokens
        self.num_samples = max(0, (len(self.stream) - 1) // seq_length)
        self.summary = summary
        self._offsets = np.arange(seq_length + 1, dtype=np.int64)

    @classmethod
    def from_options(
        cls,
        options: TextDataLoaderOptions,
        tokenizer: PreTrainedTokenizerBase,
        *,
        log: Callable[[str], None] | None = None,
    ) -> TextDataset:
        """Read, tokenize and pack the files named by `options`; log the summary line.

        Raises:
            FileNotFoundError / ValueError: missing paths, malformed records (file:line), or data too
                short for one sample.
        """
        start = time.perf_counter()
        files = list_text_files(options.data_path)
        eod = eod_token_id(tokenizer) if options.append_eod else None
        docs = (
            text
            for path in files
            for text in itertools.islice(read_documents(path, options.text_key), options.max_documents)
        )
        stream, num_docs, num_empty = tokenize_documents(docs, tokenizer, eod_id=eod)
        seq = options.seq_length
        if len(stream) < seq + 1:
            raise ValueError(
                f"train_dataset.dataloader.data_path: the data gives {len(stream):,} tokens, fewer than "
                f"seq_length + 1 = {seq + 1} needed for one sample"
            )
        num_samples = (len(stream) - 1) // seq
        summary = TextSummary(
            files=len(files),
            documents=num_docs,
            empty_documents=num_empty,
            tokens=len(stream),
            seq_length=seq,
            samples=num_samples,
            tail_tokens=len(stream) - (num_samples * seq + 1),
            seconds=time.perf_counter() - start,
        )
        if log is not None:
            log(summary.line())
        return cls(stream, seq, summary)

    def __len__(self) -> int:
        return self.num_samples

    def get_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Samples `indices` as `input_ids` and `labels` arrays of shape [len(indices), seq_length]."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_samples):
            raise IndexError(f"sample index out of range [0, {self.num_samples})")
        rows = self.stream[idx[:, None] * self.seq_length + self._offsets].astype(np.int64)
        return {"input_ids": rows[:, :-1], "labels": rows[:, 1:]}

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        batch = self.get_batch(np.asarray([index]))
        return {key: value[0] for key, value in batch.items()}


def build_text_loader(dataset_cfg: TrainDatasetConfig, ctx: LoaderContext) -> StatefulLoader:
    """The train builder of `TextDataLoader` (registered in `meshforge.data.specs`)."""
    from meshforge.data.loader import StatefulLoader

    options = dataset_cfg.dataloader.options_as(TextDataLoaderOptions)
    if ctx.tokenizer is None:
        raise ValueError("TextDataLoader: the run has no tokenizer; set model.tokenizer_name_or_path")
    dataset = TextDataset.from_options(options, ctx.tokenizer, log=ctx.log)
    return StatefulLoader.for_run(dataset, ctx, dataset_cfg)
