"""`train_dataset.dataloader.type: SFTDataLoader`: LLaMA-Factory-style SFT data through the loader.

Pipeline (LLaMA-Factory's `get_dataset` order, on the `datasets` library): resolve each dataset
(`dataset_info`), load its files, apply `num_samples` then `max_samples`, convert it to aligned
conversations (broken records keep a reason in `_error`), mix the datasets (`concat`,
`interleave_under` = first exhausted, `interleave_over` = all exhausted, seeded by training.seed),
then encode (or encode and pack) per `preprocessing_batch_size` batch with
`preprocessing_num_workers` processes. `datasets` caches each map step (`overwrite_cache` redoes
them). With `tokenized_path`, the result is saved there on the first run and loaded afterwards, and
then every other data option is ignored (said in the log).

Validation data (LLaMA-Factory's `split_dataset`): `val_size` splits the mixed, converted
examples before encoding with `Dataset.train_test_split(test_size=val_size, seed=training.seed)`
(a fraction in (0, 1), or a number of examples when > 1), so the train rows never contain a
validation example; `eval_dataset` names other datasets (as `dataset` does, same mixing), encoded
the same way. `tokenized_path` saves and loads both (`train` and `validation`).

Streaming (`streaming: true`): each file is read with `datasets.load_dataset(..., streaming=True)`,
converted and mixed lazily, then `shuffle(buffer_size, seed)`; the first `val_size` examples of
that stream are the validation set (held in memory) and the rest are encoded on the fly, one
`preprocessing_batch_size` batch at a time (packing included), and served by a `StreamLoader`.
Each epoch reshuffles the stream (`set_epoch`); validation examples are left out of every epoch.

The rows are held in memory as one flat id array plus offsets; `get_batch` pads every row to
`cutoff_len` and shifts the labels into the batch contract (labels[i] = target of position i).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from meshforge.data.sft.converters import check_columns, convert_batch
from meshforge.data.sft.dataset_info import DatasetAttr, load_raw, resolve_datasets
from meshforge.data.sft.packing import pack_batch
from meshforge.data.sft.processor import IGNORE_INDEX, encode_batch
from meshforge.data.sft.templates import get_template
from meshforge.resources import resolve_path

COLUMNS = ("input_ids", "labels", "position_ids", "segment_ids")
CONVERTED = ("_prompt", "_response", "_system", "_tools", "_error")
STOPPING = {"interleave_under": "first_exhausted", "interleave_over": "all_exhausted"}


class SFTDataset:
    """Encoded SFT rows as a loader `SampleSource` (see the module docstring)."""

    def __init__(self, columns: dict[str, list[list[int]]], *, row_length: int, pad_id: int, label_pad: int):
        self.num_rows = len(columns["input_ids"])
        self.row_length = row_length
        self.pad_id = pad_id
        self.label_pad = label_pad
        lengths = np.asarray([len(row) for row in columns["input_ids"]], dtype=np.int64)
        if self.num_rows and lengths.max() > row_length:
            raise ValueError(f"a row has {lengths.max()} tokens, more than the row length {row_length}")
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.flat = {
            key: np.fromiter(
                (t for row in columns[key] for t in row), dtype=np.int64, count=int(self.offsets[-1])
            )
            for key in COLUMNS
            if key in columns
        }

    def __len__(self) -> int:
        return self.num_rows

    def real_tokens(self) -> int:
        """Tokens that are not a pack's trailing padding (pad id, position 0, no label)."""
        total = int(self.offsets[-1])
        if "position_ids" not in self.flat:
            return total
        if "segment_ids" in self.flat:
            return int(np.count_nonzero(self.flat["segment_ids"]))
        pad = (
            (self.flat["input_ids"] == self.pad_id)
            & (self.flat["position_ids"] == 0)
            & (self.flat["labels"] == IGNORE_INDEX)
        )
        for i in range(self.num_rows):  # subtract only the trailing run of each row
            tail = pad[self.offsets[i] : self.offsets[i + 1]][::-1]
            total -= len(tail) if tail.all() else int(np.argmax(~tail))
        return total

    def row(self, index: int) -> dict[str, np.ndarray]:
        """Row `index` unpadded and unshifted (labels as LLaMA-Factory stores them)."""
        a, b = self.offsets[index], self.offsets[index + 1]
        return {key: flat[a:b] for key, flat in self.flat.items()}

    def get_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Rows padded to `row_length`; labels shifted so labels[i] is the target of token i."""
        rows = []
        for index in np.asarray(indices, dtype=np.int64):
            if not 0 <= index < self.num_rows:
                raise IndexError(f"row {index} out of range [0, {self.num_rows})")
            rows.append(self.row(int(index)))
        return pad_rows(
            rows,
            keys=[key for key in COLUMNS if key in self.flat],
            row_length=self.row_length,
            pad_id=self.pad_id,
            label_pad=self.label_pad,
        )


def pad_rows(
    rows: list[dict[str, Any]], *, keys: list[str], row_length: int, pad_id: int, label_pad: int
) -> dict[str, np.ndarray]:
    """Encoded rows (unshifted, as stored) as one batch in the batch contract.

    Every row is right-padded to `row_length` (input pad id; labels `label_pad`; position and
    segment ids 0), and labels are shifted left by one so labels[i] is the target of token i.
    """
    n, width = len(rows), row_length
    out = {"input_ids": np.full((n, width), pad_id, dtype=np.int64)}
    unshifted = np.full((n, width + 1), IGNORE_INDEX, dtype=np.int64)
    extra = [key for key in ("position_ids", "segment_ids") if key in keys]
    for key in extra:
        out[key] = np.zeros((n, width), dtype=np.int64)
    for j, row in enumerate(rows):
        length = len(row["input_ids"])
        if length > width:
            raise ValueError(f"a row has {length} tokens, more than the row length {width}")
        out["input_ids"][j, :length] = row["input_ids"]
        unshifted[j, :length] = row["labels"]
        unshifted[j, length:width] = label_pad
        for key in extra:
            out[key][j, :length] = row[key]
    out["labels"] = unshifted[:, 1:]
    return out


def _log(log: Callable[[str], None] | None, text: str) -> None:
    if log is not None:
        log(text)


def _template(cfg: Any, tokenizer: Any) -> Any:
    template = get_template(
        cfg.template,
        tokenizer,
        default_system=cfg.default_system,
        enable_thinking=cfg.enable_thinking,
        tool_format=cfg.tool_format,
        mask_history=cfg.mask_history,
    )
    if cfg.train_on_prompt and template.efficient_eos:
        raise ValueError("train_dataset.train_on_prompt: cannot be used with an efficient_eos template")
    return template


def _convert_kwargs(attr: DatasetAttr) -> dict[str, Any]:
    return {
        "formatting": attr.formatting,
        "columns": attr.columns,
        "tags": attr.tags,
        "ranking": attr.ranking,
    }


def _prepare(attr: DatasetAttr, cfg: Any, seed: int, key: str = "train_dataset.dataset") -> Any:
    """Load, subsample and convert one dataset; returns the converted `datasets.Dataset`."""
    ds = load_raw(attr)
    where = f"{key} ({attr.name}: {', '.join(map(str, attr.files))})"
    if attr.num_samples is not None:
        rng = np.random.RandomState(seed)  # LLaMA-Factory draws from numpy's global RNG seeded likewise
        order = rng.permutation(len(ds))[: attr.num_samples]
        if attr.num_samples > len(ds):
            order = np.concatenate([order, rng.choice(len(ds), attr.num_samples - len(ds))])
        ds = ds.select(order.tolist())
    if cfg.max_samples is not None:
        ds = ds.select(range(min(cfg.max_samples, len(ds))))
    check_columns(ds.column_names, attr.formatting, attr.columns, where)
    return ds.map(
        convert_batch,
        batched=True,
        batch_size=cfg.preprocessing_batch_size,
        num_proc=cfg.preprocessing_num_workers,
        remove_columns=ds.column_names,
        load_from_cache_file=not cfg.overwrite_cache,
        fn_kwargs=_convert_kwargs(attr),
        desc=f"converting {attr.name}",
    )


def _mix(converted: list[Any], cfg: Any, seed: int) -> Any:
    import datasets

    if len(converted) == 1:
        return converted[0]
    if cfg.mix_strategy == "concat":
        return datasets.concatenate_datasets(converted)
    probs = cfg.probabilities() or None
    return datasets.interleave_datasets(
        converted, probabilities=probs, seed=seed, stopping_strategy=STOPPING[cfg.mix_strategy]
    )


def _resolve(spec: Any, cfg: Any, key: str) -> list[DatasetAttr]:
    # resolve_datasets names `train_dataset.dataset` in its messages; say `eval_dataset` for that key.
    if key == "train_dataset.dataset":
        return resolve_datasets(spec, cfg.dataset_dir)
    rename = lambda text: re.sub(r"train_dataset\.dataset(?![_\w])", key, text)  # noqa: E731
    try:
        attrs = resolve_datasets(spec, cfg.dataset_dir)
    except (ValueError, FileNotFoundError) as err:
        raise type(err)(rename(str(err))) from None
    return [dataclasses.replace(attr, name=rename(attr.name)) for attr in attrs]


def _converted(spec: Any, cfg: Any, seed: int, log: Callable[[str], None] | None, key: str) -> Any:
    """The named datasets loaded, converted (broken records reported) and mixed: one `Dataset`."""
    attrs = _resolve(spec, cfg, key)
    converted = [_prepare(attr, cfg, seed, key) for attr in attrs]
    for attr, ds in zip(attrs, converted, strict=True):
        counts = Counter(e for e in ds["_error"] if e)
        if counts:
            _log(
                log,
                f"sft data: {attr.name}: dropped {sum(counts.values())} broken record(s): "
                + ", ".join(f"{reason} x{n}" for reason, n in counts.most_common()),
            )
        if len(ds) - sum(counts.values()) == 0:
            raise ValueError(
                f"{key}: {attr.name} ({attr.files[0]}) has no usable example"
                + (f" ({dict(counts)})" if counts else "")
            )
    return _mix(converted, cfg, seed)


def _encode_args(cfg: Any, tokenizer: Any, template: Any) -> tuple[Callable[..., dict], dict[str, Any]]:
    common = {
        "template": template,
        "tokenizer": tokenizer,
        "cutoff_len": cfg.cutoff_len,
        "train_on_prompt": cfg.train_on_prompt,
        "mask_history": cfg.mask_history,
    }
    if cfg.packing:
        return pack_batch, {**common, "neat": cfg.neat_packing}
    return encode_batch, common


def _encode(ds: Any, cfg: Any, tokenizer: Any, template: Any, what: str) -> Any:
    fn, kwargs = _encode_args(cfg, tokenizer, template)
    processed = ds.map(
        fn,
        batched=True,
        batch_size=cfg.preprocessing_batch_size,
        num_proc=cfg.preprocessing_num_workers,
        remove_columns=ds.column_names,
        load_from_cache_file=not cfg.overwrite_cache,
        fn_kwargs=kwargs,
        desc=("packing " if cfg.packing else "encoding ") + what,
    )
    if len(processed) == 0:
        raise ValueError(f"{what}: no example left after encoding (all broken or too long)")
    return processed


def split_validation(mixed: Any, val_size: float, seed: int) -> tuple[Any, Any]:
    """LLaMA-Factory's split of the converted examples: (train, validation) `Dataset`s.

    `val_size` in (0, 1) is a fraction; above 1 it is a number of examples (`int(val_size)`). The
    split is `mixed.train_test_split(test_size=..., seed=seed)`, so the same data and seed give
    LLaMA-Factory's validation set.

    Raises:
        ValueError: a val_size of exactly 1, or more validation examples than the data holds.
    """
    if abs(val_size - 1.0) < 1e-9:
        raise ValueError(
            "train_dataset.val_size: 1 would leave no training data; give a fraction in (0, 1) or a "
            "number of examples > 1"
        )
    test_size: float | int = int(val_size) if val_size > 1 else val_size
    if isinstance(test_size, int) and test_size >= len(mixed):
        raise ValueError(
            f"train_dataset.val_size: {test_size} validation examples, but the data has only "
            f"{len(mixed)}; lower it or give a fraction in (0, 1)"
        )
    parts = mixed.train_test_split(test_size=test_size, seed=seed)
    return parts["train"], parts["test"]


def build_sft_splits(
    cfg: Any, tokenizer: Any, *, seed: int, log: Callable[[str], None] | None = None
) -> tuple[Any, Any]:
    """Run the pipeline (no tokenized_path logic): processed (train, validation or None) `Dataset`s.

    Raises:
        ValueError / FileNotFoundError: bad dataset entries, missing columns, an empty result.
    """
    template = _template(cfg, tokenizer)
    mixed = _converted(cfg.dataset, cfg, seed, log, "train_dataset.dataset")
    valid = None
    if cfg.val_size > 1e-6:
        mixed, valid = split_validation(mixed, float(cfg.val_size), seed)
    elif cfg.eval_dataset is not None:
        valid = _converted(cfg.eval_dataset, cfg, seed, log, "train_dataset.eval_dataset")
    train = _encode(mixed, cfg, tokenizer, template, "train_dataset.dataset")
    if valid is not None:
        what = "train_dataset.val_size" if cfg.val_size > 1e-6 else "train_dataset.eval_dataset"
        valid = _encode(valid, cfg, tokenizer, template, what)
    return train, valid


def build_sft_columns(
    cfg: Any, tokenizer: Any, *, seed: int, log: Callable[[str], None] | None = None
) -> Any:
    """The processed training `Dataset` of `build_sft_splits` (validation examples left out)."""
    return build_sft_splits(cfg, tokenizer, seed=seed, log=log)[0]


def _is_rank0() -> bool:
    try:
        import torch.distributed as dist

        return not dist.is_initialized() or dist.get_rank() == 0
    except ImportError:
        return True


def _pads(cfg: Any, tokenizer: Any) -> tuple[int, int]:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return pad_id, (IGNORE_INDEX if cfg.ignore_pad_token_for_loss else pad_id)


def _rows(processed: Any, cfg: Any, tokenizer: Any, *, from_disk: bool) -> SFTDataset:
    columns = {key: processed[key] for key in COLUMNS if key in processed.column_names}
    longest = max((len(r) for r in columns["input_ids"]), default=0)
    row_length = max(cfg.cutoff_len, longest) if from_disk else cfg.cutoff_len
    pad_id, label_pad = _pads(cfg, tokenizer)
    return SFTDataset(columns, row_length=row_length, pad_id=pad_id, label_pad=label_pad)


def _summary(dataset: SFTDataset, what: str) -> str:
    tokens = dataset.real_tokens()
    flat = dataset.flat
    kind = "neat-packed" if "segment_ids" in flat else ("packed" if "position_ids" in flat else "unpacked")
    fill = tokens / max(1, len(dataset) * dataset.row_length)
    return f"{len(dataset):,} {kind} {what} rows of {dataset.row_length} tokens, {tokens:,} tokens ({fill:.0%} fill)"


def build_sft_data(
    cfg: Any, tokenizer: Any, *, seed: int, log: Callable[[str], None] | None = None
) -> tuple[SFTDataset | SFTStream, SFTDataset | None]:
    """(train, validation) of `train_dataset` (`cfg`): in-memory rows, or a stream when streaming.

    With `tokenized_path` holding saved data, that data is loaded (its `validation` part, if any,
    is the validation set) and every other data option is ignored (said in the log).
    """
    import datasets

    start = time.perf_counter()
    if not _is_rank0():
        datasets.disable_progress_bars()  # one set of progress bars per job, not one per rank
    if cfg.streaming:
        return build_sft_stream(cfg, tokenizer, seed=seed, log=log)
    path = resolve_path(cfg.tokenized_path) if cfg.tokenized_path else None
    from_disk = path is not None and path.is_dir() and any(path.iterdir())
    if from_disk:
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            train, valid = loaded["train"], loaded.get("validation")
        else:
            train, valid = loaded, None
        _log(
            log,
            f"sft data: loaded tokenized data from {path}; all other data options (dataset, template, "
            "cutoff_len, packing, val_size, eval_dataset, ...) are ignored; delete that folder to rebuild",
        )
    else:
        train, valid = build_sft_splits(cfg, tokenizer, seed=seed, log=log)
        if path is not None and _is_rank0():
            parts = {"train": train, **({"validation": valid} if valid is not None else {})}
            datasets.DatasetDict(parts).save_to_disk(str(path))
            _log(
                log,
                f"sft data: tokenized data saved to {path} (later runs load it and ignore other data options)",
            )
    train_rows = _rows(train, cfg, tokenizer, from_disk=from_disk)
    valid_rows = _rows(valid, cfg, tokenizer, from_disk=from_disk) if valid is not None else None
    text = _summary(train_rows, "train")
    if valid_rows is not None:
        text += "; " + _summary(valid_rows, "validation")
    _log(log, f"sft data: {text}; {time.perf_counter() - start:.1f}s")
    return train_rows, valid_rows


def build_sft_dataset(
    cfg: Any, tokenizer: Any, *, seed: int, log: Callable[[str], None] | None = None
) -> SFTDataset:
    """The SFT training rows of `train_dataset` (`cfg`), via `tokenized_path` when set."""
    if cfg.streaming:
        raise ValueError("train_dataset.streaming: a stream has no in-memory rows; use build_sft_data")
    train, _ = build_sft_data(cfg, tokenizer, seed=seed, log=log)
    assert isinstance(train, SFTDataset)
    return train


# ---------------------------------------------------------------------------------------------------
# streaming


class SFTStream:
    """Encoded SFT rows produced on the fly from a shuffled `datasets.IterableDataset`.

    `rows(epoch)` iterates one epoch (the stream reshuffled with `seed + epoch`, validation examples
    left out); `collate(rows)` pads them into a batch. Used by `StreamLoader`.
    """

    def __init__(
        self,
        indexed: Any,
        *,
        cfg: Any,
        seed: int,
        held_out: frozenset[int],
        encode: tuple[Callable[..., dict], dict[str, Any]],
        row_length: int,
        pad_id: int,
        label_pad: int,
        log: Callable[[str], None] | None = None,
    ):
        self.log = log
        # Broken records seen by the epoch being read, by reason (reported when the epoch ends).
        self.skipped: Counter[str] = Counter()
        self.indexed = indexed  # converted, mixed examples with a unique `_row` number, unshuffled
        self.buffer_size = int(cfg.buffer_size)
        self.batch_size = int(cfg.preprocessing_batch_size)
        self.seed = seed
        self.held_out = held_out
        self.encode = encode
        self.row_length = row_length
        self.pad_id = pad_id
        self.label_pad = label_pad

    def shuffled(self, epoch: int) -> Any:
        """The converted examples in epoch `epoch`'s order (LLaMA-Factory's `shuffle(buffer_size, seed)`)."""
        stream = self.indexed.shuffle(seed=self.seed, buffer_size=self.buffer_size)
        stream.set_epoch(epoch)  # the epoch of the dataset that is iterated counts: see rows()
        return stream

    def rows(self, epoch: int) -> Iterator[dict[str, Any]]:
        stream = self.shuffled(epoch)
        if self.held_out:
            held = self.held_out
            stream = stream.filter(lambda b: [r not in held for r in b["_row"]], batched=True)
        skipped = self.skipped = Counter()

        def count_broken(batch: dict[str, list]) -> list[bool]:
            # Keeps every row: the encoder drops the broken ones; this only counts them by reason.
            skipped.update(error for error in batch.get("_error", []) if error)
            return [True] * len(batch["_row"])

        stream = stream.filter(count_broken, batched=True)
        fn, kwargs = self.encode
        encoded = stream.map(
            fn,
            batched=True,
            batch_size=self.batch_size,
            remove_columns=[*CONVERTED, "_row"],
            fn_kwargs=kwargs,
        )
        # `datasets` reseeds the shuffle buffer from the epoch of the dataset being iterated, which
        # `filter`/`map` do not carry over: set it on the last one.
        encoded.set_epoch(epoch)
        return self._reporting(iter(encoded), epoch)

    def _reporting(self, rows: Iterator[dict[str, Any]], epoch: int) -> Iterator[dict[str, Any]]:
        """Yield the rows, then report the broken records the epoch skipped (never silently)."""
        yield from rows
        if self.skipped and self.log is not None:
            reasons = ", ".join(f"{count} {reason}" for reason, count in self.skipped.most_common())
            self.log(
                f"sft stream epoch {epoch}: skipped {sum(self.skipped.values())} broken record(s): {reasons}"
            )

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        keys = [key for key in COLUMNS if rows and key in rows[0]]
        return pad_rows(
            rows, keys=keys, row_length=self.row_length, pad_id=self.pad_id, label_pad=self.label_pad
        )


def _numbered_records(
    file_type: str, files: tuple[str, ...], split: str, base: int
) -> Iterator[dict[str, Any]]:
    """The records of `files` in order, streamed, each with `_row` = base + its position."""
    import datasets

    position = base
    for path in files:
        if os.path.getsize(path) == 0:
            continue  # `datasets` refuses an empty data file; it simply holds no record
        for record in datasets.load_dataset(file_type, data_files=[path], split=split, streaming=True):
            yield {**record, "_row": position}
            position += 1


def build_sft_stream(
    cfg: Any, tokenizer: Any, *, seed: int, log: Callable[[str], None] | None = None
) -> tuple[SFTStream, SFTDataset | None]:
    """The streamed training rows and the in-memory validation rows (see the module docstring).

    Raises:
        ValueError: options a stream cannot honour (tokenized_path), missing columns, no data.
    """
    import datasets

    if cfg.tokenized_path:
        raise ValueError(
            "train_dataset.tokenized_path: cannot be combined with streaming (a stream is encoded on the "
            "fly, nothing is saved); remove one of them"
        )
    template = _template(cfg, tokenizer)
    attrs = _resolve(cfg.dataset, cfg, "train_dataset.dataset")
    streams = []
    for k, attr in enumerate(attrs):
        where = f"train_dataset.dataset ({attr.name}: {', '.join(map(str, attr.files))})"
        if attr.num_samples is not None:
            _log(log, f"sft data: {attr.name}: num_samples is not applied when streaming (as LLaMA-Factory)")
        # One single-shard stream per dataset, its files read one after the other: the example
        # order LLaMA-Factory's `to_iterable_dataset()` of a local dataset gives, so the seeded
        # shuffle picks the same examples. Each example carries a number unique over all datasets.
        raw = datasets.IterableDataset.from_generator(
            _numbered_records,
            gen_kwargs={
                "file_type": attr.file_type,
                # a tuple, not a list: `from_generator` would make one shard per list item
                "files": tuple(str(p) for p in attr.files),
                "split": attr.split,
                "base": k << 40,
            },
        )
        first = raw.column_names or next(iter(raw), None)
        if first is None:
            raise ValueError(f"{where}: has no records")
        names = [name for name in first if name != "_row"]
        check_columns(names, attr.formatting, attr.columns, where)
        streams.append(
            raw.map(
                convert_batch,
                batched=True,
                batch_size=cfg.preprocessing_batch_size,
                remove_columns=names,
                fn_kwargs=_convert_kwargs(attr),
            )
        )
    indexed = _mix(streams, cfg, seed)
    pad_id, label_pad = _pads(cfg, tokenizer)
    encode = _encode_args(cfg, tokenizer, template)
    valid_rows = None
    held_out: frozenset[int] = frozenset()
    stream = SFTStream(
        indexed,
        cfg=cfg,
        seed=seed,
        held_out=held_out,
        encode=encode,
        row_length=cfg.cutoff_len,
        pad_id=pad_id,
        label_pad=label_pad,
        log=log,
    )
    if cfg.val_size > 1e-6:
        # LLaMA-Factory: validation = shuffled.take(val_size), train = shuffled.skip(val_size). The
        # held-out examples are remembered by number so later (reshuffled) epochs leave them out too.
        taken = list(stream.shuffled(0).take(int(cfg.val_size)))
        if len(taken) < int(cfg.val_size):
            raise ValueError(
                f"train_dataset.val_size: {int(cfg.val_size)} validation examples, but the stream has "
                f"only {len(taken)}"
            )
        stream.held_out = frozenset(int(r["_row"]) for r in taken)
        valid = datasets.Dataset.from_list([{k: r[k] for k in CONVERTED} for r in taken])
        valid = _encode(valid, cfg, tokenizer, template, "train_dataset.val_size")
        valid_rows = _rows(valid, cfg, tokenizer, from_disk=False)
    elif cfg.eval_dataset is not None:
        # Evaluation data is read whole (not streamed): it is meant to be small and is read repeatedly.
        converted = _converted(cfg.eval_dataset, cfg, seed, log, "train_dataset.eval_dataset")
        valid = _encode(converted, cfg, tokenizer, template, "train_dataset.eval_dataset")
        valid_rows = _rows(valid, cfg, tokenizer, from_disk=False)
    _log(
        log,
        f"sft data: streaming {len(attrs)} dataset(s) with a shuffle buffer of {cfg.buffer_size}, encoded "
        f"on the fly into rows of {cfg.cutoff_len} tokens"
        + (f"; {_summary(valid_rows, 'validation')}" if valid_rows is not None else "")
        + "; broken records are counted and reported at the end of each epoch",
    )
    return stream, valid_rows


# ---------------------------------------------------------------------------------------------------
# loaders

# The last (train, validation) build, so that the train and the eval loader of one run share it.
_LAST_BUILD: list[Any] = []


def _cached_data(cfg: Any, tokenizer: Any, seed: int, log: Callable[[str], None] | None) -> tuple[Any, Any]:
    if _LAST_BUILD and _LAST_BUILD[0] is cfg and _LAST_BUILD[1] is tokenizer and _LAST_BUILD[2] == seed:
        return _LAST_BUILD[3]
    data = build_sft_data(cfg, tokenizer, seed=seed, log=log)
    _LAST_BUILD[:] = [cfg, tokenizer, seed, data]
    return data


def _check_options(dataset_cfg: Any) -> None:
    from meshforge.data.specs import check_dataloader_options

    issues = check_dataloader_options("SFTDataLoader", dict(dataset_cfg.dataloader.model_extra or {}))
    if issues:
        raise ValueError("\n".join(f"train_dataset.dataloader.{k}: {r}" for k, r in issues))


def build_sft_loader(
    dataset_cfg: Any,
    *,
    tokenizer: Any,
    local_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    global_batch_size: int | None,
    log: Callable[[str], None] | None,
    total_steps: int | None = None,
) -> Any:
    """Builder registered for `SFTDataLoader` (signature of `data.build.LoaderBuilder`).

    Returns a `StatefulLoader` over in-memory rows, or a `StreamLoader` when streaming (its
    `num_samples` is None: the length of a stream is unknown).
    """
    from meshforge.data.loader import StatefulLoader, StreamLoader

    _check_options(dataset_cfg)
    train, _ = _cached_data(dataset_cfg, tokenizer, seed, log)
    if isinstance(train, SFTStream):
        if dataset_cfg.dataloader.shuffle and log is not None:
            log("note: train_dataset.dataloader.shuffle: a stream is shuffled by its buffer (buffer_size)")
        return StreamLoader(
            train.rows,
            train.collate,
            local_batch_size=local_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
            drop_remainder=bool(dataset_cfg.drop_remainder),
            global_batch_size=global_batch_size,
        )
    return StatefulLoader(
        train,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        shuffle=bool(dataset_cfg.dataloader.shuffle),
        drop_remainder=bool(dataset_cfg.drop_remainder),
        global_batch_size=global_batch_size,
    )


def build_sft_eval_loader(
    dataset_cfg: Any,
    *,
    tokenizer: Any,
    local_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    log: Callable[[str], None] | None = None,
    **_: Any,
) -> Any:
    """The `EvalLoader` of the validation rows (`val_size`, `eval_dataset`, or saved ones), or None."""
    from meshforge.data.loader import EvalLoader

    _check_options(dataset_cfg)
    _, valid = _cached_data(dataset_cfg, tokenizer, seed, log)
    if valid is None:
        return None
    return EvalLoader(valid, local_batch_size=local_batch_size, dp_rank=dp_rank, dp_size=dp_size)


__all__ = [
    "SFTDataset",
    "SFTStream",
    "build_sft_columns",
    "build_sft_data",
    "build_sft_dataset",
    "build_sft_eval_loader",
    "build_sft_loader",
    "build_sft_splits",
    "pad_rows",
    "split_validation",
]
