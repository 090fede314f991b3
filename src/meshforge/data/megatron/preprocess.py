"""`meshforge preprocess`: raw documents -> Megatron `{prefix}_{key}_document.bin/.idx` files.

A port of the behaviour of Megatron-LM's `tools/preprocess_data.py` (without sentence splitting), so
scripts port by changing the command name and the files match what Megatron writes:

- each JSON key in `--json-keys` gets its own dataset; a document is one sequence (a list value is a
  list of sentences, one sequence each); `--append-eod` adds the EOD id to the document's last
  sequence; a document with no tokens is still recorded as a document without sequences;
- text is encoded as Megatron's HF tokenizer wrappers do, `tokenizer(text).input_ids` (special
  tokens the tokenizer adds by itself, such as Llama's BOS, are kept);
- the token dtype is uint16 below 65,500 ids, else int32.

Inputs: `.jsonl` (one object per line), `.json` (an array of objects, or JSON lines), `.txt` (one
document per non-empty line, under the first json key), `.csv` (a header row, then one record per
row), `.parquet` and `.arrow` (Arrow IPC stream or file, as `datasets` writes; both need pyarrow);
a folder means all such files in it, in sorted order. A malformed record (bad JSON, missing key, non-text
value) stops the run with `file:line` unless `--skip-invalid`, which skips and counts it by reason.

Worker processes (`--workers`) parse and tokenize chunks of records; the main process writes them in
input order, so the output does not depend on the number of workers.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from meshforge.data.megatron.indexed import IndexedDatasetWriter, optimal_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SUFFIXES = (".jsonl", ".json", ".txt", ".parquet", ".arrow", ".csv")
CHUNK_RECORDS = 2048  # records per task: the tokenizer's Rust batch path needs big batches to use every core


class PreprocessError(ValueError):
    """A user-facing problem with the input or options (the message names file:line or the flag)."""


@dataclass
class PreprocessOptions:
    """What `meshforge preprocess` does; fields mirror the command-line flags."""

    input: str
    output_prefix: str
    tokenizer: str
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    append_eod: bool = False
    eod_token: str | None = None
    workers: int = 1
    skip_invalid: bool = False
    log_interval: int = 1000  # documents between progress reports (Megatron's --log-interval)


@dataclass
class PreprocessSummary:
    """Counts of one run; `lines()` is what the command prints at the end."""

    files: int = 0
    documents: int = 0
    empty_documents: int = 0
    tokens: dict[str, int] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)
    bytes_read: int = 0
    seconds: float = 0.0
    eod_id: int | None = None
    outputs: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        rate = self.documents / self.seconds if self.seconds else 0.0
        mbs = self.bytes_read / 1e6 / self.seconds if self.seconds else 0.0
        out = [
            f"done: {self.files} file(s), {self.documents:,} documents, "
            + ", ".join(f"{n:,} tokens ({k})" for k, n in self.tokens.items())
            + f" in {self.seconds:.1f}s ({rate:,.0f} docs/s, {mbs:.2f} MB/s)"
        ]
        if self.empty_documents:
            out.append(
                f"  {self.empty_documents:,} document value(s) gave no tokens (kept as empty documents)"
            )
        skipped = sum(self.skipped.values())
        out.append(f"  skipped records: {skipped:,}" + ("" if skipped else " (none)"))
        for reason, count in self.skipped.most_common():
            out.append(f"    {count:,} x {reason}")
        out += [f"  wrote {path}" for path in self.outputs]
        return out


# ---------------------------------------------------------------------------------------------------
# reading


def list_input_files(path_text: str) -> list[Path]:
    path = Path(path_text).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise PreprocessError(f"--input: folder {path} holds no {'/'.join(SUFFIXES)} file")
        return files
    if not path.is_file():
        raise PreprocessError(f"--input: no such file or folder: {path_text}")
    if path.suffix not in SUFFIXES:
        raise PreprocessError(f"--input: {path} is not a {', '.join(SUFFIXES)} file")
    return [path]


# A raw record: (where, kind, payload) with kind "json" (payload is a JSON text to parse) or "obj".
Raw = tuple[str, str, Any]


def _raw_records(path: Path, first_key: str) -> Iterator[Raw]:
    if path.suffix == ".parquet":
        yield from _parquet_records(path)
        return
    if path.suffix == ".arrow":
        yield from _arrow_records(path)
        return
    if path.suffix == ".csv":
        yield from _csv_records(path)
        return
    with path.open(encoding="utf-8", errors="strict", newline="") as f:
        if path.suffix == ".json":
            head = f.read(1)
            while head and head.isspace():
                head = f.read(1)
            if head == "[":
                f.seek(0)
                try:
                    records = json.load(f)
                except json.JSONDecodeError as exc:
                    raise PreprocessError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
                for i, record in enumerate(records):
                    yield f"{path}: item {i}", "obj", record
                return
            f.seek(0)  # Megatron's "json" inputs are JSON lines
        for lineno, line in enumerate(f, start=1):
            if path.suffix == ".txt":
                text = line.rstrip("\r\n")
                if text:
                    yield f"{path}:{lineno}", "obj", {first_key: text}
            elif line.strip():
                yield f"{path}:{lineno}", "json", line


def _parquet_records(path: Path) -> Iterator[Raw]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PreprocessError(
            f"{path}: reading .parquet needs pyarrow, which is not installed (pip install pyarrow), "
            "or convert the file to .jsonl"
        ) from None
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=CHUNK_RECORDS):
        for record in batch.to_pylist():
            yield f"{path}: row {row}", "obj", record
            row += 1


def _arrow_records(path: Path) -> Iterator[Raw]:
    try:
        import pyarrow as pa
    except ImportError:
        raise PreprocessError(
            f"{path}: reading .arrow needs pyarrow, which is not installed (pip install pyarrow)"
        ) from None
    row = 0
    with pa.memory_map(str(path)) as source:
        try:
            reader: Any = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            source.seek(0)
            try:
                file_reader = pa.ipc.open_file(source)
            except pa.ArrowInvalid as exc:
                raise PreprocessError(f"{path}: not an Arrow IPC stream or file ({exc})") from None
            reader = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
        for batch in reader:
            for record in batch.to_pylist():
                yield f"{path}: row {row}", "obj", record
                row += 1


def _csv_records(path: Path) -> Iterator[Raw]:
    import csv

    with path.open(encoding="utf-8", errors="strict", newline="") as f:
        reader = csv.DictReader(f)
        for record in reader:
            yield f"{path}:{reader.line_num}", "obj", record


def _chunks(files: list[Path], first_key: str) -> Iterator[list[Raw]]:
    chunk: list[Raw] = []
    for path in files:
        try:
            for raw in _raw_records(path, first_key):
                chunk.append(raw)
                if len(chunk) >= CHUNK_RECORDS:
                    yield chunk
                    chunk = []
        except UnicodeDecodeError as exc:
            raise PreprocessError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if chunk:
        yield chunk


# ---------------------------------------------------------------------------------------------------
# encoding (runs in the workers)

_TOKENIZER: Any = None
_KEYS: list[str] = []
_EOD: int | None = None


def _init_worker(tokenizer_path: str, keys: list[str], eod: int | None) -> None:
    # Parallelism comes from the worker processes: one Rust thread each, so N workers use N cores
    # instead of N x cores threads fighting over them. Set before the tokenizer's thread pool starts.
    os.environ["RAYON_NUM_THREADS"] = "1"
    from meshforge.data.tokenizer import build_tokenizer

    _init_worker_with(build_tokenizer(tokenizer_path), keys, eod)


def _init_worker_with(tokenizer: PreTrainedTokenizerBase, keys: list[str], eod: int | None) -> None:
    global _TOKENIZER, _KEYS, _EOD
    _TOKENIZER, _KEYS, _EOD = tokenizer, keys, eod


def _sentences(record: Any, key: str) -> list[str] | str:
    """The record's sentences under `key`, or the reason it is invalid (a str)."""
    if not isinstance(record, dict):
        return f"record is not a JSON object (got {type(record).__name__})"
    if key not in record:
        return f"missing key {key!r}"
    value = record[key]
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return f"{key!r} is not a string or a list of strings (got {type(value).__name__})"


@dataclass
class EncodedChunk:
    """One chunk's output per json key: all tokens, the sequence lengths, sequences per document."""

    tokens: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    doc_sequences: dict[str, np.ndarray]
    invalid: list[tuple[str, str]]
    nbytes: int


def encode_chunk(chunk: list[Raw]) -> EncodedChunk:
    """Parse and tokenize one chunk of records (runs in a worker); see the module docstring."""
    parsed: list[dict[str, list[str]]] = []
    invalid: list[tuple[str, str]] = []
    nbytes = 0
    for where, kind, payload in chunk:
        record = payload
        if kind == "json":
            nbytes += len(payload)
            try:
                record = json.loads(payload)
            except json.JSONDecodeError as exc:
                invalid.append((where, f"not valid JSON ({exc.msg})"))
                continue
        texts: dict[str, list[str]] = {}
        reason = None
        for key in _KEYS:
            got = _sentences(record, key)
            if isinstance(got, str):
                reason = got
                break
            texts[key] = got
        if reason is not None:
            invalid.append((where, reason))
            continue
        if kind != "json":
            nbytes += sum(len(t.encode("utf-8")) for v in texts.values() for t in v)
        parsed.append(texts)
    out = EncodedChunk({}, {}, {}, invalid, nbytes)
    for key in _KEYS:
        flat = [t for texts in parsed for t in texts[key]]
        ids = _TOKENIZER(flat, return_attention_mask=False, verbose=False)["input_ids"] if flat else []
        pieces: list[list[int]] = []
        per_doc = np.zeros(len(parsed), dtype=np.int64)
        pos = 0
        for d, texts in enumerate(parsed):
            kept = [x for x in ids[pos : pos + len(texts[key])] if x]  # empty sentences give no sequence
            pos += len(texts[key])
            if kept and _EOD is not None:
                kept[-1] = [*kept[-1], _EOD]
            pieces += kept
            per_doc[d] = len(kept)
        lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        out.tokens[key] = np.fromiter(
            itertools.chain.from_iterable(pieces), dtype=np.int64, count=int(lengths.sum())
        )
        out.lengths[key] = lengths
        out.doc_sequences[key] = per_doc
    return out


# ---------------------------------------------------------------------------------------------------
# driver


def resolve_eod(tokenizer: PreTrainedTokenizerBase, eod_token: str | None) -> tuple[int, str]:
    """(EOD id, its token): `eod_token` when given, else `<|endoftext|>`, else eos_token.

    Raises:
        PreprocessError: `eod_token` is not in the vocabulary, or the tokenizer has no candidate.
    """
    if eod_token is not None:
        vocab = tokenizer.get_vocab()
        if eod_token not in vocab:
            raise PreprocessError(f"--eod-token: {eod_token!r} is not a token of this tokenizer")
        return int(vocab[eod_token]), eod_token
    from meshforge.data.tokenizer import eod_token_id

    try:
        eod = eod_token_id(tokenizer)
    except ValueError as exc:
        raise PreprocessError(f"--append-eod: {exc}") from None
    return eod, str(tokenizer.convert_ids_to_tokens(eod))


def output_prefix(prefix: str, key: str) -> str:
    return f"{prefix}_{key}_document"


def preprocess(
    options: PreprocessOptions,
    out: TextIO | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> PreprocessSummary:
    """Run the conversion (see the module docstring); progress and the EOD id go to `out`.

    `tokenizer`, when given, is used instead of loading `options.tokenizer` (worker processes
    still load `options.tokenizer`, which must then be a folder of the same tokenizer).

    Raises:
        PreprocessError: bad input (file:line) or options.
        FileNotFoundError: the tokenizer folder does not exist.
    """
    out = out if out is not None else sys.stderr
    start = time.perf_counter()
    if not options.json_keys:
        raise PreprocessError("--json-keys: give at least one key")
    if options.workers < 1:
        raise PreprocessError(f"--workers: must be at least 1, got {options.workers}")
    files = list_input_files(options.input)
    if tokenizer is None:
        from meshforge.data.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(options.tokenizer)
    summary = PreprocessSummary(files=len(files), tokens={k: 0 for k in options.json_keys})
    eod = None
    if options.append_eod:
        eod, token = resolve_eod(tokenizer, options.eod_token)
        summary.eod_id = eod
        print(f"EOD: appending id {eod} ({token!r}) after every document", file=out, flush=True)
    dtype = optimal_dtype(len(tokenizer))
    writers = {
        key: IndexedDatasetWriter(output_prefix(options.output_prefix, key), dtype)
        for key in options.json_keys
    }
    chunks = _chunks(files, options.json_keys[0])
    pool = None
    results: Iterator[EncodedChunk]
    try:
        if options.workers > 1:
            ctx = multiprocessing.get_context("spawn")
            pool = ctx.Pool(
                options.workers,
                initializer=_init_worker,
                initargs=(options.tokenizer, options.json_keys, eod),
            )
            results = pool.imap(encode_chunk, chunks)
        else:
            _init_worker_with(tokenizer, options.json_keys, eod)
            results = map(encode_chunk, chunks)
        progress = Progress(out, options.log_interval, start)
        for encoded in results:
            summary.bytes_read += encoded.nbytes
            if encoded.invalid:
                if not options.skip_invalid:
                    where, reason = encoded.invalid[0]
                    raise PreprocessError(
                        f"{where}: {reason} (pass --skip-invalid to skip and count such records)"
                    )
                for _, reason in encoded.invalid:
                    summary.skipped[_reason_class(reason)] += 1
            first = options.json_keys[0]
            summary.documents += len(encoded.doc_sequences[first])
            for key, writer in writers.items():
                writer.add_documents(encoded.tokens[key], encoded.lengths[key], encoded.doc_sequences[key])
                summary.tokens[key] += len(encoded.tokens[key])
                summary.empty_documents += int((encoded.doc_sequences[key] == 0).sum())
            progress.update(summary.documents, summary.bytes_read)
        progress.close(summary.documents, summary.bytes_read)
    finally:
        if pool is not None:
            pool.terminate()
    for key, writer in writers.items():
        writer.finalize()
        summary.outputs += [f"{output_prefix(options.output_prefix, key)}.{ext}" for ext in ("bin", "idx")]
    summary.seconds = time.perf_counter() - start
    return summary


class Progress:
    """Progress every `interval` documents: one line rewritten in place on a terminal, else new lines."""

    def __init__(self, out: TextIO, interval: int, start: float):
        self.out, self.interval, self.start = out, max(1, interval), start
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.next = self.interval
        self.shown = False

    def _line(self, docs: int, nbytes: int) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return (
            f"processed {docs:,} documents ({docs / elapsed:,.0f} docs/s, {nbytes / 1e6 / elapsed:.2f} MB/s)"
        )

    def update(self, docs: int, nbytes: int) -> None:
        if docs < self.next:
            return
        self.next = (docs // self.interval + 1) * self.interval
        self.shown = True
        if self.tty:
            print("\r" + self._line(docs, nbytes), end="", file=self.out, flush=True)
        else:
            print(self._line(docs, nbytes), file=self.out, flush=True)

    def close(self, docs: int, nbytes: int) -> None:
        if self.tty and self.shown:
            print("\r" + self._line(docs, nbytes), file=self.out, flush=True)


def _reason_class(reason: str) -> str:
    # Group by kind, dropping the details that differ between records (JSON error positions).
    return reason.split(" (")[0] if reason.startswith("not valid JSON") else reason
