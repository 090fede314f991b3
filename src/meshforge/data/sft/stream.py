"""Streamed SFT data (`streaming: true`): rows encoded on the fly from a shuffled stream.

Each file is read with `datasets.load_dataset(..., streaming=True)`, converted and mixed lazily,
then `shuffle(buffer_size, seed)`; the first `val_size` examples of that stream are the validation
set (held in memory; `eval_dataset` is read whole instead, one part per dataset with
`eval_on_each_dataset`) and the rest are encoded on the fly, one `preprocessing_batch_size` batch at a
time (packing included), and served by a `StreamLoader`. Each epoch reshuffles the stream
(`set_epoch`); validation examples are left out of every epoch.

Resume re-reads: the shuffle buffer of a `datasets` stream is not part of any saved state, so the
`StreamLoader` restores its position by reading (and encoding) the epoch's stream again from its
start up to the saved row count; the time this takes grows with the position.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import numpy as np

from meshforge.data.context import MIXED_EVAL
from meshforge.data.sft.converters import check_columns, convert_batch
from meshforge.data.sft.pipeline import (
    COLUMNS,
    CONVERTED,
    SFTDataset,
    build_template,
    convert_kwargs,
    encode_dataset,
    encode_parts,
    encoder,
    mix_datasets,
    pad_ids,
    pad_rows,
    parts_summary,
    resolve_attrs,
    say,
    to_rows,
    validation_converted,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PreTrainedTokenizerBase

    from meshforge.data.config import TrainDatasetConfig
    from meshforge.data.sft.arrow import ArrowStream, EncodedRow
    from meshforge.data.sft.pipeline import Encoder


class SFTStream:
    """Encoded SFT rows produced on the fly from a shuffled `datasets.IterableDataset`.

    `rows(epoch)` iterates one epoch (the stream reshuffled with `seed + epoch`, validation examples
    left out); `collate(rows)` pads them into a batch. Used by `StreamLoader`.
    """

    def __init__(
        self,
        indexed: ArrowStream,
        *,
        cfg: TrainDatasetConfig,
        seed: int,
        held_out: frozenset[int],
        encode: tuple[Encoder, dict[str, object]],
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

    def shuffled(self, epoch: int) -> ArrowStream:
        """The converted examples in epoch `epoch`'s order (LLaMA-Factory's `shuffle(buffer_size, seed)`)."""
        stream = self.indexed.shuffle(seed=self.seed, buffer_size=self.buffer_size)
        stream.set_epoch(epoch)  # the epoch of the dataset that is iterated counts: see rows()
        return stream

    def rows(self, epoch: int) -> Iterator[EncodedRow]:
        stream = self.shuffled(epoch)
        if self.held_out:
            held = self.held_out
            stream = stream.filter(lambda b: [r not in held for r in b["_row"]], batched=True)
        skipped = self.skipped = Counter()

        def count_broken(batch: dict[str, list[object]]) -> list[bool]:
            # Keeps every row: the encoder drops the broken ones; this only counts them by reason.
            reasons = cast("list[str]", batch.get("_error", []))  # the converters' reasons
            skipped.update(error for error in reasons if error)
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
        # Only the encoder's columns are left: lists of token ids.
        return self._reporting(cast("Iterator[EncodedRow]", iter(encoded)), epoch)

    def _reporting(self, rows: Iterator[EncodedRow], epoch: int) -> Iterator[EncodedRow]:
        """Yield the rows, then report the broken records the epoch skipped (never silently)."""
        yield from rows
        if self.skipped and self.log is not None:
            reasons = ", ".join(f"{count} {reason}" for reason, count in self.skipped.most_common())
            self.log(
                f"sft stream epoch {epoch}: skipped {sum(self.skipped.values())} broken record(s): {reasons}"
            )

    def collate(self, rows: list[EncodedRow]) -> dict[str, np.ndarray]:
        keys = [key for key in COLUMNS if rows and key in rows[0]]
        return pad_rows(
            rows, keys=keys, row_length=self.row_length, pad_id=self.pad_id, label_pad=self.label_pad
        )


def _numbered_records(
    file_type: str, files: tuple[str, ...], split: str, base: int
) -> Iterator[dict[str, object]]:
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
    cfg: TrainDatasetConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    log: Callable[[str], None] | None = None,
    pairwise: bool = False,
) -> tuple[SFTStream, dict[str, SFTDataset]]:
    """The streamed training rows and the in-memory validation parts (name -> rows, see the module docstring).

    `pairwise`: ranking datasets encoded into pair rows of up to `2 * cutoff_len` tokens (dpo).

    Raises:
        ValueError: options a stream cannot honour (tokenized_path), missing columns, no data.
    """
    import datasets

    if cfg.tokenized_path:
        raise ValueError(
            "train_dataset.tokenized_path: cannot be combined with streaming (a stream is encoded on the "
            "fly, nothing is saved); remove one of them"
        )
    template = build_template(cfg, tokenizer)
    attrs = resolve_attrs(cfg.dataset, cfg, "train_dataset.dataset", pairwise=pairwise)
    streams = []
    for k, attr in enumerate(attrs):
        where = f"train_dataset.dataset ({attr.name}: {', '.join(map(str, attr.files))})"
        if attr.num_samples is not None:
            say(log, f"sft data: {attr.name}: num_samples is not applied when streaming (as LLaMA-Factory)")
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
                fn_kwargs=convert_kwargs(attr),
            )
        )
    indexed = mix_datasets(streams, cfg, seed)
    pad_id, label_pad = pad_ids(cfg, tokenizer)
    encode = encoder(cfg, tokenizer, template, pairwise=pairwise)
    row_length = 2 * cfg.cutoff_len if pairwise else cfg.cutoff_len
    parts: dict[str, SFTDataset] = {}
    held_out: frozenset[int] = frozenset()
    stream = SFTStream(
        indexed,
        cfg=cfg,
        seed=seed,
        held_out=held_out,
        encode=encode,
        row_length=row_length,
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
        stream.held_out = frozenset(cast(int, r["_row"]) for r in taken)  # set by _numbered_records
        valid = datasets.Dataset.from_list([{k: r[k] for k in CONVERTED} for r in taken])
        valid = encode_dataset(valid, cfg, tokenizer, template, "train_dataset.val_size", pairwise=pairwise)
        parts[MIXED_EVAL] = to_rows(valid, cfg, tokenizer, from_disk=False, pairwise=pairwise)
    elif cfg.eval_dataset is not None:
        # Evaluation data is read whole (not streamed): it is meant to be small and is read
        # repeatedly; with eval_on_each_dataset, one part per dataset, as without streaming.
        converted = validation_converted(cfg, seed, log, pairwise=pairwise)
        encoded = encode_parts(
            converted, cfg, tokenizer, template, "train_dataset.eval_dataset", pairwise=pairwise
        )
        parts = {
            name: to_rows(ds, cfg, tokenizer, from_disk=False, pairwise=pairwise)
            for name, ds in encoded.items()
        }
    say(
        log,
        f"sft data: streaming {len(attrs)} dataset(s) with a shuffle buffer of {cfg.buffer_size}, encoded "
        f"on the fly into {'pair ' if pairwise else ''}rows of {row_length} tokens"
        + (f"; {parts_summary(parts)}" if parts else "")
        + "; broken records are counted and reported at the end of each epoch",
    )
    return stream, parts
