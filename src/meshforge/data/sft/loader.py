"""`train_dataset.dataloader.type: SFTDataLoader`: LLaMA-Factory-style SFT data through the loader.

Pipeline (LLaMA-Factory's `get_dataset` order, on the `datasets` library): resolve each dataset
(`dataset_info`), load its files, apply `num_samples` then `max_samples`, convert it to aligned
conversations (broken records keep a reason in `_error`), mix the datasets (`concat`,
`interleave_under` = first exhausted, `interleave_over` = all exhausted, seeded by training.seed),
then encode (or encode and pack) per `preprocessing_batch_size` batch with
`preprocessing_num_workers` processes. `datasets` caches each map step (`overwrite_cache` redoes
them). With `tokenized_path`, the result is saved there on the first run and loaded afterwards, and
then every other data option is ignored (said in the log).

The rows are held in memory as one flat id array plus offsets; `get_batch` pads every row to
`cutoff_len` and shifts the labels into the batch contract (labels[i] = target of position i).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from meshforge.data.sft.converters import check_columns, convert_batch
from meshforge.data.sft.dataset_info import DatasetAttr, load_raw, resolve_datasets
from meshforge.data.sft.packing import pack_batch
from meshforge.data.sft.processor import IGNORE_INDEX, encode_batch
from meshforge.data.sft.templates import get_template
from meshforge.resources import resolve_path

COLUMNS = ("input_ids", "labels", "position_ids", "segment_ids")
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
        n, width = len(indices), self.row_length
        out = {"input_ids": np.full((n, width), self.pad_id, dtype=np.int64)}
        unshifted = np.full((n, width + 1), IGNORE_INDEX, dtype=np.int64)
        if "position_ids" in self.flat:
            out["position_ids"] = np.zeros((n, width), dtype=np.int64)
        if "segment_ids" in self.flat:
            out["segment_ids"] = np.zeros((n, width), dtype=np.int64)
        for j, index in enumerate(np.asarray(indices, dtype=np.int64)):
            if not 0 <= index < self.num_rows:
                raise IndexError(f"row {index} out of range [0, {self.num_rows})")
            row = self.row(int(index))
            length = len(row["input_ids"])
            out["input_ids"][j, :length] = row["input_ids"]
            unshifted[j, :length] = row["labels"]
            unshifted[j, length:width] = self.label_pad
            for key in ("position_ids", "segment_ids"):
                if key in out:
                    out[key][j, :length] = row[key]
        out["labels"] = unshifted[:, 1:]
        return out


def _log(log: Callable[[str], None] | None, text: str) -> None:
    if log is not None:
        log(text)


def _prepare(attr: DatasetAttr, cfg: Any, seed: int) -> Any:
    """Load, subsample and convert one dataset; returns the converted `datasets.Dataset`."""
    ds = load_raw(attr)
    where = f"train_dataset.dataset ({attr.name}: {', '.join(map(str, attr.files))})"
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
        fn_kwargs={
            "formatting": attr.formatting,
            "columns": attr.columns,
            "tags": attr.tags,
            "ranking": attr.ranking,
        },
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


def build_sft_columns(
    cfg: Any, tokenizer: Any, *, seed: int, log: Callable[[str], None] | None = None
) -> Any:
    """Run the pipeline (no tokenized_path logic) and return the processed `datasets.Dataset`.

    Raises:
        ValueError / FileNotFoundError: bad dataset entries, missing columns, an empty result.
    """
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
    attrs = resolve_datasets(cfg.dataset, cfg.dataset_dir)
    converted = [_prepare(attr, cfg, seed) for attr in attrs]
    errors = Counter()
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
                f"train_dataset.dataset: {attr.name} ({attr.files[0]}) has no usable example"
                + (f" ({dict(counts)})" if counts else "")
            )
        errors.update(counts)
    mixed = _mix(converted, cfg, seed)
    common = {
        "template": template,
        "tokenizer": tokenizer,
        "cutoff_len": cfg.cutoff_len,
        "train_on_prompt": cfg.train_on_prompt,
        "mask_history": cfg.mask_history,
    }
    if cfg.packing:
        fn, kwargs = pack_batch, {**common, "neat": cfg.neat_packing}
    else:
        fn, kwargs = encode_batch, common
    processed = mixed.map(
        fn,
        batched=True,
        batch_size=cfg.preprocessing_batch_size,
        num_proc=cfg.preprocessing_num_workers,
        remove_columns=mixed.column_names,
        load_from_cache_file=not cfg.overwrite_cache,
        fn_kwargs=kwargs,
        desc="packing" if cfg.packing else "encoding",
    )
    if len(processed) == 0:
        raise ValueError("train_dataset.dataset: no example left after encoding (all broken or too long)")
    return processed


def _is_rank0() -> bool:
    try:
        import torch.distributed as dist

        return not dist.is_initialized() or dist.get_rank() == 0
    except ImportError:
        return True


def build_sft_dataset(
    cfg: Any, tokenizer: Any, *, seed: int, log: Callable[[str], None] | None = None
) -> SFTDataset:
    """The SFT rows of `train_dataset` (`cfg`), via `tokenized_path` when set (see the module docstring)."""
    import datasets

    start = time.perf_counter()
    if not _is_rank0():
        datasets.disable_progress_bars()  # one set of progress bars per job, not one per rank
    path = resolve_path(cfg.tokenized_path) if cfg.tokenized_path else None
    if path is not None and path.is_dir() and any(path.iterdir()):
        loaded = datasets.load_from_disk(str(path))
        processed = loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded
        _log(
            log,
            f"sft data: loaded tokenized data from {path}; all other data options (dataset, template, "
            "cutoff_len, packing, ...) are ignored; delete that folder to rebuild",
        )
    else:
        processed = build_sft_columns(cfg, tokenizer, seed=seed, log=log)
        if path is not None and _is_rank0():
            datasets.DatasetDict({"train": processed}).save_to_disk(str(path))
            _log(
                log,
                f"sft data: tokenized data saved to {path} (later runs load it and ignore other data options)",
            )
    columns = {key: processed[key] for key in COLUMNS if key in processed.column_names}
    longest = max((len(r) for r in columns["input_ids"]), default=0)
    row_length = cfg.cutoff_len if path is None else max(cfg.cutoff_len, longest)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    label_pad = IGNORE_INDEX if cfg.ignore_pad_token_for_loss else pad_id
    dataset = SFTDataset(columns, row_length=row_length, pad_id=pad_id, label_pad=label_pad)
    tokens = dataset.real_tokens()
    kind = (
        "neat-packed" if "segment_ids" in columns else ("packed" if "position_ids" in columns else "unpacked")
    )
    _log(
        log,
        f"sft data: {len(dataset):,} {kind} rows of {row_length} tokens, {tokens:,} tokens "
        f"({tokens / max(1, len(dataset) * row_length):.0%} fill); {time.perf_counter() - start:.1f}s",
    )
    return dataset


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
    """Builder registered for `SFTDataLoader` (signature of `data.build.LoaderBuilder`)."""
    from meshforge.data.loader import StatefulLoader
    from meshforge.data.specs import check_dataloader_options

    issues = check_dataloader_options("SFTDataLoader", dict(dataset_cfg.dataloader.model_extra or {}))
    if issues:
        raise ValueError("\n".join(f"train_dataset.dataloader.{k}: {r}" for k, r in issues))
    dataset = build_sft_dataset(dataset_cfg, tokenizer, seed=seed, log=log)
    return StatefulLoader(
        dataset,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        shuffle=bool(dataset_cfg.dataloader.shuffle),
        drop_remainder=bool(dataset_cfg.drop_remainder),
        global_batch_size=global_batch_size,
    )


__all__ = ["SFTDataset", "build_sft_columns", "build_sft_dataset", "build_sft_loader"]
