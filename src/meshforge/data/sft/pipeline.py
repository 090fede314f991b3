"""The SFT data pipeline on the `datasets` library, and the in-memory rows it produces.

Order (LLaMA-Factory's `get_dataset`): resolve each dataset (`dataset_info`), load its files, apply
`num_samples` then `max_samples`, convert it to aligned conversations (broken records keep a
reason in `_error`), mix the datasets (`concat`, `interleave_under` = first exhausted,
`interleave_over` = all exhausted, seeded by training.seed), then encode (or encode and pack) per
`preprocessing_batch_size` batch with `preprocessing_num_workers` processes. `datasets` caches each
map step (`overwrite_cache` redoes them).

Validation data (LLaMA-Factory's `split_dataset`): `val_size` splits the mixed, converted
examples before encoding with `Dataset.train_test_split(test_size=val_size, seed=training.seed)`
(a fraction in (0, 1), or a number of examples when > 1), so the train rows never contain a
validation example; `eval_dataset` names other datasets (as `dataset` does, same mixing), encoded
the same way. With `eval_on_each_dataset` (LLaMA-Factory's rule) each `eval_dataset` is converted and
encoded (packed within itself) on its own and kept as one part per dataset name, never mixed; a
`val_size` split stays one part, as it is taken from the mixed training data. The parts are keyed by
dataset name, the one mixed validation set by `MIXED_EVAL` ("").

The rows are held in memory as one flat id array plus offsets (`SFTDataset`); `get_batch` pads
every row to `cutoff_len` and shifts the labels into the batch contract (labels[i] = target of
position i).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar, cast

import numpy as np

from meshforge.data.context import MIXED_EVAL
from meshforge.data.sft.arrow import ArrowDataset
from meshforge.data.sft.converters import check_columns, convert_batch
from meshforge.data.sft.dataset_info import DatasetAttr, load_raw, resolve_datasets
from meshforge.data.sft.packing import pack_batch
from meshforge.data.sft.pairwise import encode_pair_batch, pack_pair_batch
from meshforge.data.sft.processor import IGNORE_INDEX, encode_batch
from meshforge.data.sft.templates import Template, get_template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.data.config import TrainDatasetConfig

COLUMNS = ("input_ids", "labels", "position_ids", "segment_ids")
# Pair rows are padded to a multiple of this many tokens (see `SFTDataset.get_batch`).
PAIR_PAD_MULTIPLE = 64
CONVERTED = ("_prompt", "_response", "_system", "_tools", "_error")
STOPPING = {"interleave_under": "first_exhausted", "interleave_over": "all_exhausted"}
D = TypeVar("D")  # a `datasets.Dataset` or `IterableDataset` (`arrow.ArrowDataset` / `ArrowStream`)
Encoder = Callable[..., dict[str, list]]


class SFTDataset:
    """Encoded SFT rows as a loader `SampleSource` (see the module docstring)."""

    def __init__(
        self,
        columns: Mapping[str, Sequence[Sequence[int]]],
        *,
        row_length: int,
        pad_id: int,
        label_pad: int,
        pairwise: bool = False,
    ):
        # pairwise: each row is one pair (chosen segment 1, rejected segment 2; see pairwise.py).
        self.pairwise = pairwise
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
        """Rows padded to `row_length`; labels shifted so labels[i] is the target of token i.

        Pair rows (up to `2 * cutoff_len`, usually far shorter) are padded only to the batch's
        longest row rounded up to `PAIR_PAD_MULTIPLE` tokens (a length tensor and sequence
        parallelism divide), so a short pair does not pay for attention over the whole row.
        """
        rows = []
        for index in np.asarray(indices, dtype=np.int64):
            if not 0 <= index < self.num_rows:
                raise IndexError(f"row {index} out of range [0, {self.num_rows})")
            rows.append(self.row(int(index)))
        width = self.row_length
        if self.pairwise and rows:
            longest = max(len(row["input_ids"]) for row in rows)
            width = min(width, -(-longest // PAIR_PAD_MULTIPLE) * PAIR_PAD_MULTIPLE)
        return pad_rows(
            rows,
            keys=[key for key in COLUMNS if key in self.flat],
            row_length=width,
            pad_id=self.pad_id,
            label_pad=self.label_pad,
        )


def pad_rows(
    rows: Sequence[Mapping[str, Sequence[int] | np.ndarray]],
    *,
    keys: list[str],
    row_length: int,
    pad_id: int,
    label_pad: int,
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


def say(log: Callable[[str], None] | None, text: str) -> None:
    if log is not None:
        log(text)


def build_template(cfg: TrainDatasetConfig, tokenizer: PreTrainedTokenizerBase) -> Template:
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


def convert_kwargs(attr: DatasetAttr) -> dict[str, object]:
    return {
        "formatting": attr.formatting,
        "columns": attr.columns,
        "tags": attr.tags,
        "ranking": attr.ranking,
    }


def prepare_dataset(
    attr: DatasetAttr, cfg: TrainDatasetConfig, seed: int, key: str = "train_dataset.dataset"
) -> ArrowDataset:
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
        fn_kwargs=convert_kwargs(attr),
        desc=f"converting {attr.name}",
    )


def mix_datasets(converted: list[D], cfg: TrainDatasetConfig, seed: int) -> D:
    import datasets

    if len(converted) == 1:
        return converted[0]
    if cfg.mix_strategy == "concat":
        return datasets.concatenate_datasets(converted)
    probs = cfg.probabilities() or None
    return datasets.interleave_datasets(
        converted, probabilities=probs, seed=seed, stopping_strategy=STOPPING[cfg.mix_strategy]
    )


def resolve_attrs(
    spec: object, cfg: TrainDatasetConfig, key: str, *, pairwise: bool = False
) -> list[DatasetAttr]:
    # resolve_datasets names `train_dataset.dataset` in its messages; say `eval_dataset` for that key.
    if key == "train_dataset.dataset":
        return resolve_datasets(spec, cfg.dataset_dir, ranking=pairwise)
    rename = lambda text: re.sub(r"train_dataset\.dataset(?![_\w])", key, text)  # noqa: E731
    try:
        attrs = resolve_datasets(spec, cfg.dataset_dir, ranking=pairwise)
    except (ValueError, FileNotFoundError) as err:
        raise type(err)(rename(str(err))) from None
    return [dataclasses.replace(attr, name=rename(attr.name)) for attr in attrs]


def converted_datasets(
    spec: object,
    cfg: TrainDatasetConfig,
    seed: int,
    log: Callable[[str], None] | None,
    key: str,
    *,
    pairwise: bool = False,
) -> ArrowDataset:
    """The named datasets loaded, converted (broken records reported) and mixed: one `Dataset`."""
    parts = converted_each(spec, cfg, seed, log, key, pairwise=pairwise)
    return mix_datasets(list(parts.values()), cfg, seed)


def converted_each(
    spec: object,
    cfg: TrainDatasetConfig,
    seed: int,
    log: Callable[[str], None] | None,
    key: str,
    *,
    pairwise: bool = False,
) -> dict[str, ArrowDataset]:
    """The named datasets loaded and converted, each on its own: dataset name -> `Dataset`.

    Raises:
        ValueError: a dataset with no usable example, or one named twice (its parts would share
            one name).
    """
    attrs = resolve_attrs(spec, cfg, key, pairwise=pairwise)
    names = [attr.name for attr in attrs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"{key}: {', '.join(twice)} named more than once")
    converted = [prepare_dataset(attr, cfg, seed, key) for attr in attrs]
    for attr, ds in zip(attrs, converted, strict=True):
        counts = Counter(e for e in ds["_error"] if e)
        if counts:
            say(
                log,
                f"sft data: {attr.name}: dropped {sum(counts.values())} broken record(s): "
                + ", ".join(f"{reason} x{n}" for reason, n in counts.most_common()),
            )
        if len(ds) - sum(counts.values()) == 0:
            raise ValueError(
                f"{key}: {attr.name} ({attr.files[0]}) has no usable example"
                + (f" ({dict(counts)})" if counts else "")
            )
    return dict(zip(names, converted, strict=True))


def encoder(
    cfg: TrainDatasetConfig, tokenizer: PreTrainedTokenizerBase, template: Template, *, pairwise: bool = False
) -> tuple[Encoder, dict[str, object]]:
    if pairwise:  # pairs in neat-packed rows (pairwise.py): one per row, or several with packing
        pair_kwargs: dict[str, object] = {
            "template": template,
            "tokenizer": tokenizer,
            "cutoff_len": cfg.cutoff_len,
        }
        return (pack_pair_batch if cfg.packing else encode_pair_batch), pair_kwargs
    common: dict[str, object] = {
        "template": template,
        "tokenizer": tokenizer,
        "cutoff_len": cfg.cutoff_len,
        "train_on_prompt": cfg.train_on_prompt,
        "mask_history": cfg.mask_history,
    }
    if cfg.packing:
        # MindSpeed's reset_attention_mask (documents split at their EOD, which append_eod puts
        # there) is neat packing here: the packer knows where each example ends.
        return pack_batch, {**common, "neat": cfg.neat_packing or cfg.reset_attention_mask}
    return encode_batch, common


def encode_dataset(
    ds: ArrowDataset,
    cfg: TrainDatasetConfig,
    tokenizer: PreTrainedTokenizerBase,
    template: Template,
    what: str,
    *,
    pairwise: bool = False,
) -> ArrowDataset:
    fn, kwargs = encoder(cfg, tokenizer, template, pairwise=pairwise)
    processed = ds.map(
        fn,
        batched=True,
        batch_size=cfg.preprocessing_batch_size,
        num_proc=cfg.preprocessing_num_workers,
        remove_columns=ds.column_names,
        load_from_cache_file=not cfg.overwrite_cache,
        fn_kwargs=kwargs,
        desc=("packing " if cfg.packing else "encoding ") + ("pairs of " if pairwise else "") + what,
    )
    if len(processed) == 0:
        raise ValueError(f"{what}: no example left after encoding (all broken or too long)")
    return processed


def split_validation(mixed: ArrowDataset, val_size: float, seed: int) -> tuple[ArrowDataset, ArrowDataset]:
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
    cfg: TrainDatasetConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    log: Callable[[str], None] | None = None,
    pairwise: bool = False,
) -> tuple[ArrowDataset, dict[str, ArrowDataset]]:
    """Run the pipeline (no tokenized_path logic): the processed train `Dataset` and validation parts.

    The parts are empty without validation data, `{MIXED_EVAL: dataset}` for one validation set,
    and dataset name -> `Dataset` with `eval_on_each_dataset` and `eval_dataset`. `pairwise`:
    ranking datasets (only), one pair row each (`pairwise.py`).

    Raises:
        ValueError / FileNotFoundError: bad dataset entries, missing columns, an empty result.
    """
    template = build_template(cfg, tokenizer)
    mixed = converted_datasets(cfg.dataset, cfg, seed, log, "train_dataset.dataset", pairwise=pairwise)
    converted: dict[str, ArrowDataset] = {}
    what = "train_dataset.eval_dataset"
    if cfg.val_size > 1e-6:
        mixed, converted[MIXED_EVAL] = split_validation(mixed, float(cfg.val_size), seed)
        what = "train_dataset.val_size"
    elif cfg.eval_dataset is not None:
        converted = validation_converted(cfg, seed, log, pairwise=pairwise)
    train = encode_dataset(mixed, cfg, tokenizer, template, "train_dataset.dataset", pairwise=pairwise)
    return train, encode_parts(converted, cfg, tokenizer, template, what, pairwise=pairwise)


def validation_converted(
    cfg: TrainDatasetConfig, seed: int, log: Callable[[str], None] | None, *, pairwise: bool = False
) -> dict[str, ArrowDataset]:
    """The converted `eval_dataset`: one mixed part, or one part per dataset (eval_on_each_dataset)."""
    key = "train_dataset.eval_dataset"
    if cfg.eval_on_each_dataset:
        return converted_each(cfg.eval_dataset, cfg, seed, log, key, pairwise=pairwise)
    return {MIXED_EVAL: converted_datasets(cfg.eval_dataset, cfg, seed, log, key, pairwise=pairwise)}


def encode_parts(
    parts: dict[str, ArrowDataset],
    cfg: TrainDatasetConfig,
    tokenizer: PreTrainedTokenizerBase,
    template: Template,
    what: str,
    *,
    pairwise: bool = False,
) -> dict[str, ArrowDataset]:
    """Each validation part encoded (packed within itself) on its own; messages name the part."""
    return {
        name: encode_dataset(
            ds, cfg, tokenizer, template, f"{what} ({name})" if name else what, pairwise=pairwise
        )
        for name, ds in parts.items()
    }


def build_sft_columns(
    cfg: TrainDatasetConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    log: Callable[[str], None] | None = None,
) -> ArrowDataset:
    """The processed training `Dataset` of `build_sft_splits` (validation examples left out)."""
    return build_sft_splits(cfg, tokenizer, seed=seed, log=log)[0]


def is_rank0() -> bool:
    try:
        import torch.distributed as dist

        return not dist.is_initialized() or dist.get_rank() == 0
    except ImportError:
        return True


def pad_ids(cfg: TrainDatasetConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[int, int]:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return pad_id, (IGNORE_INDEX if cfg.ignore_pad_token_for_loss else pad_id)


def to_rows(
    processed: ArrowDataset,
    cfg: TrainDatasetConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    from_disk: bool,
    pairwise: bool = False,
) -> SFTDataset:
    # The encoders wrote these columns: lists of token ids (arrow.EncodedRow).
    columns = {
        key: cast("Sequence[Sequence[int]]", processed[key])
        for key in COLUMNS
        if key in processed.column_names
    }
    longest = max((len(r) for r in columns["input_ids"]), default=0)
    # A pair row holds two sequences of at most cutoff_len each.
    cutoff = 2 * cfg.cutoff_len if pairwise else cfg.cutoff_len
    row_length = max(cutoff, longest) if from_disk else cutoff
    pad_id, label_pad = pad_ids(cfg, tokenizer)
    return SFTDataset(columns, row_length=row_length, pad_id=pad_id, label_pad=label_pad, pairwise=pairwise)


def rows_summary(dataset: SFTDataset, what: str) -> str:
    tokens = dataset.real_tokens()
    flat = dataset.flat
    several = dataset.pairwise and bool(dataset.num_rows) and int(flat["segment_ids"].max()) > 2
    kind = (
        ("packed pair" if several else "pair")
        if dataset.pairwise
        else "neat-packed"
        if "segment_ids" in flat
        else ("packed" if "position_ids" in flat else "unpacked")
    )
    fill = tokens / max(1, len(dataset) * dataset.row_length)
    return f"{len(dataset):,} {kind} {what} rows of {dataset.row_length} tokens, {tokens:,} tokens ({fill:.0%} fill)"


def parts_summary(parts: dict[str, SFTDataset]) -> str:
    """The validation rows of every part, each named (the mixed one as plain "validation")."""
    return "; ".join(
        rows_summary(rows, f"validation ({name})" if name else "validation") for name, rows in parts.items()
    )
