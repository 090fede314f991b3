"""Megatron's GPTDataset: fixed-length samples cut from shuffled documents, with cached indices.

Same corpus, seq_length, seed and split give the same samples in the same order as Megatron-LM's
(megatron-core) GPTDataset; the tests compare both. The rules (megatron-core 0.16's `datasets/gpt_dataset.py` and `helpers.cpp`):

- Epochs: the smallest e with `e * tokens_per_epoch >= num_samples * seq_length + 1` (the +1 is
  `add_extra_token_to_sequence`: a sample holds seq_length + 1 tokens, neighbours share one).
- One `numpy.random.RandomState(seed)` stream draws, in order, the document index (documents tiled
  e times and shuffled; the last epoch shuffled on its own when it is used for less than 80% of an
  epoch), then the shuffle index (the same split in two ranges).
- The sample index holds, per sample boundary, (position in the document index, token offset). It is
  computed here in closed form with numpy: boundary s sits at global token s * seq_length of the
  concatenated shuffled documents, found by `searchsorted` over their cumulative lengths. That gives
  what Megatron's sequential C++ walk gives, at numpy speed (about 0.1 s for 100M tokens).

Indices are saved as .npy files named by the md5 of a description of everything they depend on (the
data files' sizes included), in `path_to_cache` or `<data dir>/cache/GPTDataset_indices`; rank 0 builds
and writes them (atomically), the other ranks wait on the `barrier` and memory-map them.

Samples come out two ways: `sample(i)` is Megatron's dict (`tokens, labels, loss_mask,
position_ids[, attention_mask][, actual_seq_len]`), and `get_batch` is the meshforge batch contract
(`input_ids`, `labels` with -100 where the loss mask is 0, `position_ids`, and `segment_ids` 1..n per
document when documents are separated by `reset_attention_mask` or `create_compressed_eod_mask`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshforge.data.megatron.indexed import IndexedDataset, idx_path

SPLIT_NAMES = ("train", "valid", "test")
EOD_PAD_LENGTH = 128  # MindFormers' fixed length of actual_seq_len with create_compressed_eod_mask
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.8


def load_index_cache(file: Path) -> np.ndarray:
    """A cached index array, memory-mapped; never unpickled (`allow_pickle=False`).

    Raises:
        ValueError: naming the file, when it is not a plain integer array (a damaged cache, or an
            array of Python objects, which would be pickles).
    """
    try:
        array = np.load(file, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(
            f"{file}: not an index cache meshforge writes ({err}); delete it to have it rebuilt"
        ) from None
    if not isinstance(array, np.ndarray) or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{file}: not an index cache meshforge writes (not an integer array); delete it")
    return array


@dataclass(frozen=True)
class GPTDatasetConfig:
    """Everything a GPTDataset's samples depend on besides the data.

    Attributes:
        seq_length: tokens per sample (model input length).
        seed: the RandomState seed of the document and shuffle indices.
        eod: end-of-document id (loss masking, position reset, document separation).
        pad: id padding a final partial sample; -1 (Megatron's default) never occurs in data.
        reset_position_ids: restart position ids after each EOD.
        reset_attention_mask: no attention across EODs (emitted as `segment_ids`).
        eod_mask_loss: no loss where the input token is EOD.
        create_attention_mask: `sample()` also returns the [1, S, S] bool mask (True = masked).
        create_compressed_eod_mask: `sample()` also returns `actual_seq_len` (MindFormers).
        eod_pad_length: length `actual_seq_len` is padded to.
        add_extra_token_to_sequence: samples of seq_length + 1 tokens (Megatron's default).
        drop_last_partial_validation_sequence: for the valid split, drop a final partial sample.
        path_to_cache: folder of the .npy indices; None = `<data dir>/cache/GPTDataset_indices`.
    """

    seq_length: int
    seed: int = 1234
    eod: int | None = None
    pad: int = -1
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = False
    create_compressed_eod_mask: bool = False
    eod_pad_length: int = EOD_PAD_LENGTH
    add_extra_token_to_sequence: bool = True
    drop_last_partial_validation_sequence: bool = True
    path_to_cache: str | None = None

    @property
    def separates_documents(self) -> bool:
        return self.reset_attention_mask or self.create_compressed_eod_mask


# ---------------------------------------------------------------------------------------------------
# split


def parse_split(split: str) -> list[float]:
    """`'969, 30, 1'` -> normalised weights of the train, valid and test splits.

    Raises:
        ValueError: no number, more than three, or all zero.
    """
    values = [float(v) for v in re.findall(r"[.0-9]+", str(split))]
    if not values or len(values) > 3:
        raise ValueError(f"split: expected 1 to 3 comma-separated numbers like '99,1,0', got {split!r}")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise ValueError(f"split: the parts must not all be 0, got {split!r}")
    return [v / total for v in values]


def split_document_indices(num_documents: int, split: str) -> list[np.ndarray | None]:
    """Contiguous, unshuffled document ranges of each split (None where the split is 0)."""
    weights = parse_split(split)
    bounds = [0.0]
    for w in weights:
        bounds.append(bounds[-1] + w)
    result: list[np.ndarray | None] = []
    for i, w in enumerate(weights):
        if w == 0:
            result.append(None)
            continue
        beg = int(round(bounds[i] * float(num_documents)))
        end = int(round(bounds[i + 1] * float(num_documents)))
        result.append(np.arange(beg, end, dtype=np.int32))
    return result


# ---------------------------------------------------------------------------------------------------
# index construction


def num_epochs_needed(tokens_per_epoch: int, num_samples: int | None, seq_length: int, extra: int) -> int:
    """Smallest e with `e * tokens_per_epoch >= num_samples * seq_length + extra` (1 when unsized)."""
    if num_samples is None:
        return 1
    if tokens_per_epoch <= extra:
        raise ValueError(f"the split holds {tokens_per_epoch} tokens: not enough for one sample")
    need = num_samples * seq_length + extra
    return max(1, -(-need // tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """Documents tiled `epochs` times and shuffled (the last epoch apart when `separate_final_epoch`)."""
    if not separate_final_epoch or epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(
    sizes: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    epochs: int,
    tokens_per_epoch: int,
    drop_last_partial: bool = True,
    extra: int = 1,
) -> np.ndarray:
    """[n + 1, 2] array of (document-index position, offset) at each sample boundary.

    Sample s spans global tokens [s*L, s*L + L + extra) of the shuffled documents laid end to end
    (L = seq_length). Its end record names the document holding its last token t and the offset
    `t - start_of_that_document + 1 - extra` (with extra=1 the shared token starts the next sample).
    Empty documents never hold a token, so `searchsorted(side="right") - 1` skips them as the C++
    walk does. A final partial sample (kept only when not dropping) ends at the last token.
    """
    total = epochs * tokens_per_epoch
    if drop_last_partial:
        n = (total - extra) // seq_length
    else:
        n = int(np.ceil((total - extra) / seq_length))
    lengths = sizes[document_index].astype(np.int64)
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    last_tokens = np.arange(1, n + 1, dtype=np.int64) * seq_length + (extra - 1)
    clipped = last_tokens > total - 1
    last_tokens = np.minimum(last_tokens, total - 1)
    positions = np.searchsorted(starts, last_tokens, side="right") - 1
    offsets = last_tokens - starts[positions] + 1 - extra
    if clipped.any():
        # The C++ walk runs off the end of the document index and stops at its last entry.
        positions[clipped] = len(document_index) - 1
        offsets[clipped] = int(sizes[document_index[-1]]) - extra
    peak = max(len(document_index), int(sizes.max()) if len(sizes) else 0)
    dtype = np.int32 if peak <= np.iinfo(np.int32).max else np.int64
    index = np.zeros((n + 1, 2), dtype=dtype)
    index[1:, 0] = positions
    index[1:, 1] = offsets
    return index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """`arange(total_size)` shuffled, `[0, num_samples)` and `[num_samples, total_size)` separately."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_indices(
    sizes: np.ndarray,
    documents: np.ndarray,
    num_samples: int | None,
    config: GPTDatasetConfig,
    split: str = "train",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (document, sample, shuffle) indices of one split: Megatron's algorithm and RNG order."""
    seq = config.seq_length
    extra = int(config.add_extra_token_to_sequence)
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq, extra)
    separate_final = False
    sans_final = 0
    if epochs > 1:
        assert num_samples is not None  # num_epochs_needed gives 1 to an unsized split
        sans_final = ((epochs - 1) * tokens_per_epoch - extra) // seq
        per_epoch = (tokens_per_epoch - extra) // seq
        separate_final = (num_samples - sans_final) < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
    rng = np.random.RandomState(config.seed)
    document_index = build_document_index(documents, epochs, rng, separate_final)
    drop_last = not (split == "valid" and not config.drop_last_partial_validation_sequence)
    sample_index = build_sample_index(sizes, document_index, seq, epochs, tokens_per_epoch, drop_last, extra)
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(sans_final if separate_final else total, total, rng)
    return document_index, sample_index, shuffle_index


# ---------------------------------------------------------------------------------------------------
# dataset


class GPTDataset:
    """One split of one indexed dataset, as Megatron's GPTDataset (see the module docstring).

    Args:
        indexed: the `.bin/.idx` data.
        documents: the split's document (sequence) ids, from `split_document_indices`.
        num_samples: samples wanted (epochs are added to reach it); None = one epoch.
        config: sample and index settings.
        split: "train", "valid" or "test" (part of the cache names).
        rank: this process's global rank; rank 0 builds missing cache files.
        barrier: called by every rank between the build and the load (None in one process).
        log: receives one line about the build or cache hit.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: np.ndarray,
        num_samples: int | None,
        config: GPTDatasetConfig,
        *,
        split: str = "train",
        rank: int = 0,
        barrier: Callable[[], None] | None = None,
        log: Callable[[str], None] | None = None,
    ):
        if config.seq_length <= 1:
            raise ValueError(f"seq_length must be at least 2, got {config.seq_length}")
        if split not in SPLIT_NAMES:
            raise ValueError(f"split must be one of {SPLIT_NAMES}, got {split!r}")
        self.indexed = indexed
        self.documents = np.asarray(documents, dtype=np.int32)
        self.config = config
        tokens = int(indexed.sequence_lengths[self.documents].sum(dtype=np.int64))
        if tokens <= int(config.add_extra_token_to_sequence) + 1:
            raise ValueError(
                f"{indexed.prefix} ({split} split): {len(self.documents)} documents with {tokens} tokens, too "
                "few for one sample; check the split proportions or the data"
            )
        self.split = split
        self.requested_samples = num_samples
        self.description = self._describe(num_samples)
        self.description_hash = hashlib.md5(self.description.encode("utf-8")).hexdigest()
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build(rank, barrier, log)
        self.num_samples = len(self.shuffle_index)
        self._arange = np.arange(config.seq_length, dtype=np.int64)

    # -- indices and their cache -------------------------------------------------------------------

    def _describe(self, num_samples: int | None) -> str:
        docs = self.documents
        stat = idx_path(self.indexed.prefix).stat()
        fields = {
            "class": "GPTDataset",
            "dataset_path": self.indexed.prefix,
            "index_split": self.split,
            "num_samples": num_samples,
            "documents": [int(docs[0]), int(docs[-1]) + 1, len(docs)] if len(docs) else [0, 0, 0],
            "sequences": len(self.indexed),
            "tokens": self.indexed.num_tokens,
            "idx_bytes": stat.st_size,
            "random_seed": self.config.seed,
            "sequence_length": self.config.seq_length,
            "add_extra_token_to_sequence": self.config.add_extra_token_to_sequence,
            "drop_last_partial_validation_sequence": self.config.drop_last_partial_validation_sequence,
        }
        return json.dumps(fields, indent=4, sort_keys=True)

    def cache_dir(self) -> Path:
        if self.config.path_to_cache:
            return Path(self.config.path_to_cache)
        return Path(self.indexed.prefix).parent / "cache" / "GPTDataset_indices"

    def cache_paths(self) -> dict[str, Path]:
        base = f"{self.description_hash}-GPTDataset-{self.split}"
        folder = self.cache_dir()
        names = ("description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy")
        return {name.split(".")[0]: folder / f"{base}-{name}" for name in names}

    def _load_or_build(
        self, rank: int, barrier: Callable[[], None] | None, log: Callable[[str], None] | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        paths = self.cache_paths()
        hit = all(p.is_file() for p in paths.values())
        where = f"{self.indexed.prefix} ({self.split})"
        if not hit and rank == 0:
            start = time.perf_counter()
            arrays = build_indices(
                self.indexed.sequence_lengths, self.documents, self.requested_samples, self.config, self.split
            )
            self._save(paths, arrays)
            if log is not None:
                log(
                    f"GPTDataset {where}: built indices for {len(arrays[2]):,} samples in "
                    f"{time.perf_counter() - start:.2f}s -> {paths['description'].parent}"
                )
        elif hit and log is not None:
            log(f"GPTDataset {where}: loaded cached indices {paths['description'].name[:32]}")
        if barrier is not None:
            barrier()
        if not all(p.is_file() for p in paths.values()):
            raise FileNotFoundError(
                f"GPTDataset {where}: rank 0 did not write the index cache {paths['description']}; "
                "path_to_cache must be a folder every rank can read (a shared filesystem), or set "
                "train_dataset.no_shared_storage: true to build a copy on every node"
            )
        return (
            load_index_cache(paths["document_index"]),
            load_index_cache(paths["sample_index"]),
            load_index_cache(paths["shuffle_index"]),
        )

    def _save(self, paths: dict[str, Path], arrays: tuple[np.ndarray, ...]) -> None:
        folder = paths["description"].parent
        folder.mkdir(parents=True, exist_ok=True)
        # Write under temporary names and rename: a crash never leaves a complete-looking cache.
        for key, array in zip(("document_index", "sample_index", "shuffle_index"), arrays, strict=True):
            tmp = paths[key].with_name(paths[key].name + f".tmp{os.getpid()}.npy")
            np.save(tmp, array, allow_pickle=False)
            os.replace(tmp, paths[key])
        tmp = paths["description"].with_name(paths["description"].name + f".tmp{os.getpid()}")
        tmp.write_text(self.description, encoding="utf-8")
        os.replace(tmp, paths["description"])

    # -- samples -----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_samples

    def text(self, index: int) -> np.ndarray:
        """The seq_length + extra raw token ids of sample `index` (after shuffling), int64, padded."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        extra = int(self.config.add_extra_token_to_sequence)
        j = int(self.shuffle_index[index])
        beg, beg_off = (int(v) for v in self.sample_index[j])
        end, end_off = (int(v) for v in self.sample_index[j + 1])
        parts = []
        for i in range(beg, end + 1):
            offset = beg_off if i == beg else 0
            length = None if i < end else end_off - offset + extra
            parts.append(self.indexed.get(int(self.document_index[i]), offset, length))
        text = np.concatenate(parts).astype(np.int64) if len(parts) > 1 else parts[0].astype(np.int64)
        want = self.config.seq_length + extra
        if len(text) < want:
            text = np.concatenate([text, np.full(want - len(text), self.config.pad, dtype=np.int64)])
        return text

    def sample(self, index: int, text: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Megatron's sample dict for `index` (numpy): tokens, labels, loss_mask, position_ids, ...

        `text` may pass the sample's raw tokens when the caller already read them.
        """
        cfg = self.config
        if text is None:
            text = self.text(index)
        if cfg.add_extra_token_to_sequence:
            tokens, labels = text[:-1].copy(), text[1:].copy()
        else:
            tokens, labels = text.copy(), np.roll(text, -1)
            labels[-1] = cfg.pad
        seq = len(tokens)
        eod_positions = (
            np.flatnonzero(tokens == cfg.eod) if cfg.eod is not None else np.zeros(0, dtype=np.int64)
        )
        loss_mask = np.ones(seq, dtype=np.float32)
        if cfg.eod_mask_loss and cfg.eod is not None:
            loss_mask[eod_positions] = 0.0
        position_ids = self._arange[:seq].copy()
        if cfg.reset_position_ids and len(eod_positions):
            # Each document restarts at 0 after its EOD (the EOD keeps the earlier document's number).
            doc_start = np.zeros(seq, dtype=np.int64)
            doc_start[eod_positions[eod_positions + 1 < seq] + 1] = eod_positions[eod_positions + 1 < seq] + 1
            position_ids -= np.maximum.accumulate(doc_start)
        out: dict[str, np.ndarray] = {}
        loss_mask[labels == cfg.pad] = 0.0
        tokens[tokens == cfg.pad] = 0
        labels[labels == cfg.pad] = 0
        out.update(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids)
        if cfg.create_attention_mask:
            allowed = np.tril(np.ones((seq, seq), dtype=bool))
            if cfg.reset_attention_mask:
                doc = self.document_numbers(eod_positions, seq)
                allowed &= doc[:, None] == doc[None, :]
            out["attention_mask"] = ~allowed[None]
        if cfg.create_compressed_eod_mask:
            out["actual_seq_len"] = self.actual_seq_len(eod_positions, seq)
        return out

    @staticmethod
    def document_numbers(eod_positions: np.ndarray, seq: int) -> np.ndarray:
        """0-based document number of each position; an EOD belongs to the document it ends."""
        marks = np.zeros(seq, dtype=np.int64)
        after = eod_positions + 1
        np.add.at(marks, after[after < seq], 1)
        return np.cumsum(marks)

    def actual_seq_len(self, eod_positions: np.ndarray, seq: int) -> np.ndarray:
        """MindFormers' compressed EOD mask: document ends (EOD position + 1), padded with seq_length.

        Raises:
            ValueError: more documents end in the sample than `eod_pad_length` holds.
        """
        ends = eod_positions[eod_positions < seq - 1] + 1  # a final EOD closes the row anyway
        limit = self.config.eod_pad_length
        if len(ends) > limit:
            raise ValueError(
                f"create_compressed_eod_mask: a sample holds {len(ends)} document ends, more than "
                f"eod_pad_length={limit}; raise eod_pad_length or use longer documents"
            )
        out = np.full(limit, seq, dtype=np.int32)
        out[: len(ends)] = ends
        return out

    def contract_sample(self, index: int) -> dict[str, np.ndarray]:
        """Sample `index` in the meshforge batch contract (see the module docstring)."""
        cfg = self.config
        text = self.text(index)
        s = self.sample(index, text)
        labels = np.where(s["loss_mask"] > 0, s["labels"], -100)
        out = {"input_ids": s["tokens"], "labels": labels, "position_ids": s["position_ids"]}
        if cfg.separates_documents:
            tokens = text[: cfg.seq_length]
            eods = np.flatnonzero(tokens == cfg.eod) if cfg.eod is not None else np.zeros(0, np.int64)
            segments = self.document_numbers(eods, cfg.seq_length) + 1
            segments[tokens == cfg.pad] = 0  # padding of a final partial sample
            out["segment_ids"] = segments
        return out

    def get_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Samples `indices` stacked: the `SampleSource` interface of `meshforge.data.loader`."""
        rows = [self.contract_sample(int(i)) for i in np.asarray(indices).reshape(-1)]
        return {key: np.stack([row[key] for row in rows]) for key in rows[0]}
