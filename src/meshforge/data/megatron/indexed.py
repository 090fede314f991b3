"""Megatron indexed datasets: the `.bin` token file and its `.idx` index, read and written.

Pretraining corpora arrive preprocessed by Megatron-LM's `tools/preprocess_data.py`; reading them
unchanged (and writing files Megatron reads unchanged) is the point of this module, so the layout is
Megatron's, byte for byte (megatron-core's `datasets/indexed_dataset.py`):

    .idx: b"MMIDIDX\\x00\\x00" | <Q version=1 | <B dtype code | <Q sequence count | <Q document count
          | int32 sequence_lengths[seq] | int64 sequence_pointers[seq] | int64 document_indices[doc]
          (| int8 sequence_modes[seq], multimodal only)
    .bin: the tokens of all sequences, concatenated, in the dtype named by the code.

`sequence_pointers` are byte offsets into the `.bin`; `document_indices` start at 0 and document i
spans sequences `[di[i], di[i+1])` (one sequence per document unless sentences were split). Both
files are memory-mapped, so opening a 100 GB corpus costs nothing and a read is one slice, O(1).
"""

from __future__ import annotations

import struct
from pathlib import Path
from types import TracebackType

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count

DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int | None) -> type[np.number]:
    """Megatron's token dtype for a vocabulary: uint16 below 65,500 ids, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


class IndexedDataset:
    """Read-only, memory-mapped view of `{prefix}.bin` / `{prefix}.idx`.

    Args:
        prefix: path without the extension (`data/corpus_text_document`).

    Raises:
        FileNotFoundError: either file is missing.
        ValueError: the index is not a Megatron index (magic, version, dtype code, sizes), naming the file.
    """

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        idx, bin_ = idx_path(prefix), bin_path(prefix)
        for path in (idx, bin_):
            if not path.is_file():
                raise FileNotFoundError(
                    f"Megatron indexed dataset file not found: {path} (a data_path entry names the prefix "
                    "without .bin/.idx, e.g. data/corpus_text_document)"
                )
        idx_size = idx.stat().st_size
        if idx_size < HEADER.size:
            # numpy cannot map an empty file; say what is wrong with which file instead.
            raise ValueError(f"{idx}: too short for a Megatron index header ({idx_size} bytes)")
        raw = np.memmap(idx, mode="r", dtype=np.uint8)
        magic, version, code, seq_count, doc_count = HEADER.unpack(raw[: HEADER.size].tobytes())
        if magic != MAGIC:
            raise ValueError(f"{idx}: not a Megatron .idx file (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise ValueError(f"{idx}: index version {version} is not supported (only {VERSION})")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx}: unknown dtype code {code} (valid: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        offset = HEADER.size
        need = offset + seq_count * (4 + 8) + doc_count * 8
        if len(raw) < need:
            raise ValueError(
                f"{idx}: truncated ({len(raw)} bytes, the header's counts need {need}); rewrite the index"
            )
        self.sequence_lengths = np.frombuffer(raw, dtype=np.int32, count=seq_count, offset=offset)
        offset += seq_count * 4
        self.sequence_pointers = np.frombuffer(raw, dtype=np.int64, count=seq_count, offset=offset)
        offset += seq_count * 8
        self.document_indices = np.frombuffer(raw, dtype=np.int64, count=doc_count, offset=offset)
        offset += doc_count * 8
        self.multimodal = len(raw) >= offset + seq_count and len(raw) > offset
        self.sequence_modes = (
            np.frombuffer(raw, dtype=np.int8, count=seq_count, offset=offset) if self.multimodal else None
        )
        self._idx_raw = raw
        size = bin_.stat().st_size
        expected = int(self.sequence_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        if size < expected:
            raise ValueError(
                f"{bin_}: {size} bytes but its index describes {expected}; the .bin and .idx do not match"
            )
        self._check_layout(idx, bin_, size)
        # An empty .bin cannot be memory-mapped; an empty corpus is still a valid (empty) dataset.
        self._bin = np.memmap(bin_, mode="r", dtype=self.dtype) if size else np.zeros(0, self.dtype)

    def _check_layout(self, idx: Path, bin_: Path, bin_size: int) -> None:
        """Refuse an index whose arrays cannot describe the .bin (a corrupt or foreign file).

        One vectorised pass over the index arrays (well under a second for 10^8 sequences), so a
        bad pointer fails here, naming the file, instead of a read returning a short slice later.
        """
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        if len(lengths) and int(lengths.min()) < 0:
            raise ValueError(f"{idx}: a sequence length is negative; the index is corrupt, rewrite it")
        ends = pointers + lengths.astype(np.int64) * self.dtype.itemsize
        if len(pointers) and (int(pointers.min()) < 0 or int(ends.max()) > bin_size):
            bad = int(np.flatnonzero((pointers < 0) | (ends > bin_size))[0])
            raise ValueError(
                f"{idx}: sequence {bad} points at bytes [{int(pointers[bad])}, {int(ends[bad])}) outside "
                f"{bin_} ({bin_size} bytes); the .bin and .idx do not match"
            )
        if len(docs) and (int(docs[0]) != 0 or int(docs[-1]) != len(lengths) or np.any(np.diff(docs) < 0)):
            raise ValueError(
                f"{idx}: document indices must rise from 0 to the sequence count {len(lengths)}; "
                "the index is corrupt, rewrite it"
            )

    def __len__(self) -> int:
        """Number of sequences (what GPTDataset counts as documents)."""
        return len(self.sequence_lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `index` (to its end when length is None).

        A view into the memory map: no copy and no read beyond the requested bytes.
        """
        seq_len = int(self.sequence_lengths[index])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(
                f"{self.prefix}: tokens [{offset}, {offset + length}) out of sequence {index} of length {seq_len}"
            )
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return self._bin[start : start + length]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)


class IndexedDatasetWriter:
    """Write `{prefix}.bin` and `{prefix}.idx` in Megatron's layout, streaming tokens to disk.

    Usage: `add_document(tokens)` per document (or `add_item` per sentence then `end_document()`),
    then `finalize()`; or use it as a context manager, which finalizes on a clean exit.

    Args:
        prefix: output path without extension; parent folders are created.
        dtype: token dtype (see `optimal_dtype`).
    """

    def __init__(self, prefix: str | Path, dtype: type[np.number] | np.dtype = np.int32):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(
                f"dtype {self.dtype} has no Megatron code (valid: {sorted(map(str, CODE_OF_DTYPE))})"
            )
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin = bin_path(prefix).open("wb")
        self._lengths: list[int] = []
        self._doc_indices: list[int] = [0]
        self._finalized = False

    def add_item(self, tokens: np.ndarray | list[int]) -> None:
        """Append one sequence (a sentence, or a whole document)."""
        array = np.asarray(tokens)
        if array.size and (array.min() < np.iinfo(self.dtype).min or array.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids out of range for {self.dtype}: [{array.min()}, {array.max()}]")
        self._bin.write(np.ascontiguousarray(array, dtype=self.dtype).tobytes(order="C"))
        self._lengths.append(int(array.size))

    def end_document(self) -> None:
        """Close the current document (after its sentences were added with `add_item`)."""
        self._doc_indices.append(len(self._lengths))

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        """Append one document held as a single sequence (Megatron's default without sentence split)."""
        self.add_item(tokens)
        self.end_document()

    def add_documents(
        self, tokens: np.ndarray, lengths: np.ndarray, sequences_per_document: np.ndarray
    ) -> None:
        """Append many documents at once: all their tokens, each sequence's length, each document's
        number of sequences (0 for a document without tokens). One write, no per-document Python."""
        tokens = np.asarray(tokens)
        if tokens.size and (
            tokens.min() < np.iinfo(self.dtype).min or tokens.max() > np.iinfo(self.dtype).max
        ):
            raise ValueError(f"token ids out of range for {self.dtype}: [{tokens.min()}, {tokens.max()}]")
        if int(np.sum(lengths)) != tokens.size or int(np.sum(sequences_per_document)) != len(lengths):
            raise ValueError("lengths and sequences_per_document do not add up to the tokens given")
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes(order="C"))
        base = len(self._lengths)
        self._lengths.extend(np.asarray(lengths, dtype=np.int64).tolist())
        self._doc_indices.extend((base + np.cumsum(sequences_per_document, dtype=np.int64)).tolist())

    def add_index(self, other_prefix: str | Path) -> None:
        """Append every sequence and document of another indexed dataset (to merge worker shards)."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{other_prefix}: dtype {other.dtype} differs from {self.dtype}")
        base = len(self._lengths)
        self._lengths.extend(other.sequence_lengths.tolist())
        self._doc_indices.extend((other.document_indices[1:] + base).tolist())
        with bin_path(other_prefix).open("rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)

    def finalize(self) -> None:
        """Close the .bin and write the .idx."""
        if self._finalized:
            return
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.asarray(self._doc_indices, dtype=np.int64)
        with idx_path(self.prefix).open("wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[self.dtype], len(lengths), len(documents)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(documents.tobytes(order="C"))
        self._finalized = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self._bin.close()
