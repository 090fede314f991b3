"""`train_dataset.dataloader.type: SFTDataLoader`: LLaMA-Factory-style SFT data through the loader.

The data comes from the pipeline of `pipeline.py` (in-memory rows) or, with `streaming: true`,
from `stream.py` (rows encoded on the fly). With `tokenized_path`, the in-memory result is saved
there on the first run and loaded afterwards, and then every other data option is ignored (said in
the log); `tokenized_path` saves and loads both parts (`train` and `validation`, or with
`eval_on_each_dataset` one validation split per dataset and the file naming them).

The train and the eval loader of one run come from one pipeline run: the builders keep it in the
run's `LoaderContext.shared`, keyed by the section and tokenizer they were built for.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshforge.data.context import MIXED_EVAL
from meshforge.data.prepare import preparers_first
from meshforge.data.sft.pipeline import (
    SFTDataset,
    build_sft_columns,
    build_sft_splits,
    is_rank0,
    pad_rows,
    parts_summary,
    rows_summary,
    say,
    split_validation,
    to_rows,
)
from meshforge.data.sft.stream import SFTStream, build_sft_stream
from meshforge.utils.resources import resolve_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.data.config import TrainDatasetConfig
    from meshforge.data.context import LoaderContext
    from meshforge.data.loader import EvalLoader, StatefulLoader, StreamLoader
    from meshforge.data.sft.arrow import ArrowDataset


Parts = dict[str, SFTDataset]

# In a `tokenized_path` folder with one validation part per dataset, the parts are the splits
# `validation_0`, `validation_1`, ... (split names allow no paths or dashes, dataset names do)
# and this file lists their dataset names in that order.
PART_NAMES_FILE = "eval_dataset_names.json"
# In a `tokenized_path` folder of preference data (pair rows, `pairwise.py`): this file marks it,
# so a dpo run never reads SFT rows as pairs, nor an SFT run pairs as packed examples.
PAIRWISE_FILE = "pair_rows.txt"


def build_sft_parts(
    cfg: TrainDatasetConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    log: Callable[[str], None] | None = None,
    pairwise: bool = False,
) -> tuple[SFTDataset | SFTStream, Parts]:
    """(train, validation parts) of `train_dataset` (`cfg`): in-memory rows, or a stream when streaming.

    The parts are empty without validation data, `{MIXED_EVAL: rows}` for one validation set, and
    dataset name -> rows with `eval_on_each_dataset`. With `tokenized_path` holding saved data,
    that data is loaded (its validation part or parts, if any) and every other data option is
    ignored (said in the log). `pairwise`: preference data, one pair row per ranking example
    (`pairwise.py`; streaming and `tokenized_path` are refused for it by the config checks).
    """
    import datasets

    start = time.perf_counter()
    if not is_rank0():
        datasets.disable_progress_bars()  # one set of progress bars per job, not one per rank
    if cfg.streaming:
        return build_sft_stream(cfg, tokenizer, seed=seed, log=log, pairwise=pairwise)
    # LLaMA-Factory's rule: the first rank of each node prepares (node-local caches), or with
    # train_dataset.data_shared_file_system the job's rank 0 alone; the others then load the
    # `datasets` cache, or `tokenized_path` when it is set, instead of tokenising again.
    with preparers_first(per_node=not cfg.data_shared_file_system) as preparer:
        train, valid, from_disk = _prepare_splits(
            cfg, tokenizer, seed=seed, preparer=preparer, log=log, pairwise=pairwise
        )
    train_rows = to_rows(train, cfg, tokenizer, from_disk=from_disk, pairwise=pairwise)
    parts = {
        name: to_rows(ds, cfg, tokenizer, from_disk=from_disk, pairwise=pairwise)
        for name, ds in valid.items()
    }
    text = rows_summary(train_rows, "train") + (f"; {parts_summary(parts)}" if parts else "")
    say(log, f"sft data: {text}; {time.perf_counter() - start:.1f}s")
    return train_rows, parts


def build_sft_data(
    cfg: TrainDatasetConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    log: Callable[[str], None] | None = None,
) -> tuple[SFTDataset | SFTStream, SFTDataset | None]:
    """(train, the one validation set or None) of `build_sft_parts`.

    Raises:
        ValueError: the validation data is one part per dataset (use `build_sft_parts`).
    """
    train, parts = build_sft_parts(cfg, tokenizer, seed=seed, log=log)
    if parts and MIXED_EVAL not in parts:
        raise ValueError(
            f"train_dataset.eval_on_each_dataset: the validation data is {len(parts)} separate part(s) "
            f"({', '.join(parts)}), not one set; read them with build_sft_parts"
        )
    return train, parts.get(MIXED_EVAL)


def _prepare_splits(
    cfg: TrainDatasetConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    preparer: bool,
    log: Callable[[str], None] | None,
    pairwise: bool = False,
) -> tuple[ArrowDataset, dict[str, ArrowDataset], bool]:
    """(train, validation parts, whether they came from `tokenized_path`) as `datasets` objects.

    A preparing rank saves `tokenized_path` when it is set and empty; the ranks after it then find
    that folder filled and load it.
    """
    path = resolve_path(cfg.tokenized_path) if cfg.tokenized_path else None
    from_disk = path is not None and path.is_dir() and any(path.iterdir())
    if from_disk:
        assert path is not None
        saved_pairs = (path / PAIRWISE_FILE).is_file()
        if saved_pairs != pairwise:
            held, wanted = (
                ("pair rows of a dpo run", "SFT rows") if saved_pairs else ("SFT rows", "pair rows")
            )
            raise ValueError(
                f"train_dataset.tokenized_path: {path} holds {held}; this run (training.stage) needs "
                f"{wanted}: name another folder, or delete that one to rebuild"
            )
        train, valid = _load_tokenized(path)
        say(
            log,
            f"sft data: loaded tokenized data from {path}; all other data options (dataset, template, "
            "cutoff_len, packing, val_size, eval_dataset, eval_on_each_dataset, ...) are ignored; delete "
            "that folder to rebuild",
        )
    else:
        train, valid = build_sft_splits(cfg, tokenizer, seed=seed, log=log, pairwise=pairwise)
        if path is not None and preparer:
            _save_tokenized(path, train, valid)
            if pairwise:
                (path / PAIRWISE_FILE).write_text("pair rows for training.stage: dpo\n", encoding="utf-8")
            say(
                log,
                f"sft data: tokenized data saved to {path} (later runs load it and ignore other data options)",
            )
    return train, valid, from_disk


def _save_tokenized(path: Path, train: ArrowDataset, valid: dict[str, ArrowDataset]) -> None:
    """`train` and the validation part(s) as one `DatasetDict` (see `PART_NAMES_FILE`)."""
    import datasets

    if set(valid) <= {MIXED_EVAL}:
        splits = {"train": train, **({"validation": valid[MIXED_EVAL]} if valid else {})}
        datasets.DatasetDict(splits).save_to_disk(str(path))
        return
    names = list(valid)
    splits = {"train": train, **{f"validation_{i}": valid[name] for i, name in enumerate(names)}}
    datasets.DatasetDict(splits).save_to_disk(str(path))
    (path / PART_NAMES_FILE).write_text(json.dumps(names, indent=1) + "\n", encoding="utf-8")


def _load_tokenized(path: Path) -> tuple[ArrowDataset, dict[str, ArrowDataset]]:
    """What `_save_tokenized` wrote (or a plain saved `Dataset`, read as train data only)."""
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if not isinstance(loaded, datasets.DatasetDict):
        return loaded, {}
    names_file = path / PART_NAMES_FILE
    if names_file.is_file():
        names = json.loads(names_file.read_text(encoding="utf-8"))
        missing = [f"validation_{i}" for i in range(len(names)) if f"validation_{i}" not in loaded]
        if missing:
            raise ValueError(
                f"train_dataset.tokenized_path: {path} names {len(names)} validation parts in "
                f"{PART_NAMES_FILE} but has no split {', '.join(missing)}; delete that folder to rebuild"
            )
        return loaded["train"], {name: loaded[f"validation_{i}"] for i, name in enumerate(names)}
    valid = loaded.get("validation")
    return loaded["train"], ({MIXED_EVAL: valid} if valid is not None else {})


def build_sft_dataset(
    cfg: TrainDatasetConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    log: Callable[[str], None] | None = None,
    pairwise: bool = False,
) -> SFTDataset:
    """The SFT training rows of `train_dataset` (`cfg`), via `tokenized_path` when set."""
    if cfg.streaming:
        raise ValueError("train_dataset.streaming: a stream has no in-memory rows; use build_sft_data")
    train, _ = build_sft_parts(cfg, tokenizer, seed=seed, log=log, pairwise=pairwise)
    assert isinstance(train, SFTDataset)
    return train


SHARED_KEY = "sft_data"


@dataclass(frozen=True)
class _Built:
    """One pipeline result and the section and tokenizer it was built from."""

    dataset_cfg: TrainDatasetConfig
    tokenizer: PreTrainedTokenizerBase | None
    data: tuple[SFTDataset | SFTStream, Parts]


def _shared_data(dataset_cfg: TrainDatasetConfig, ctx: LoaderContext) -> tuple[SFTDataset | SFTStream, Parts]:
    """The run's (train, validation parts) data, built on the first call for this context."""
    kept = ctx.shared.get(SHARED_KEY)
    if isinstance(kept, _Built) and kept.dataset_cfg is dataset_cfg and kept.tokenizer is ctx.tokenizer:
        return kept.data
    if ctx.tokenizer is None:
        raise ValueError("SFTDataLoader: the run has no tokenizer; set model.tokenizer_name_or_path")
    data = build_sft_parts(dataset_cfg, ctx.tokenizer, seed=ctx.seed, log=ctx.log, pairwise=ctx.pairwise)
    ctx.shared[SHARED_KEY] = _Built(dataset_cfg, ctx.tokenizer, data)
    return data


def build_sft_loader(dataset_cfg: TrainDatasetConfig, ctx: LoaderContext) -> StatefulLoader | StreamLoader:
    """The train builder of `SFTDataLoader` (registered in `meshforge.data.specs`).

    Returns a `StatefulLoader` over in-memory rows, or a `StreamLoader` when streaming (its
    `num_samples` is None: the length of a stream is unknown).
    """
    from meshforge.data.loader import StatefulLoader, StreamLoader

    train, _ = _shared_data(dataset_cfg, ctx)
    if isinstance(train, SFTStream):
        if dataset_cfg.dataloader.shuffle:
            ctx.say(
                "note: train_dataset.dataloader.shuffle: a stream is shuffled by its buffer (buffer_size)"
            )
        return StreamLoader(
            train.rows,
            train.collate,
            local_batch_size=ctx.local_batch_size,
            dp_rank=ctx.dp_rank,
            dp_size=ctx.dp_size,
            seed=ctx.seed,
            drop_remainder=dataset_cfg.drop_remainder,
            global_batch_size=ctx.global_batch_size,
        )
    return StatefulLoader.for_run(train, ctx, dataset_cfg)


def build_sft_eval_loader(dataset_cfg: TrainDatasetConfig, ctx: LoaderContext) -> EvalLoader | None:
    """The `EvalLoader` of the one validation set (`val_size`, `eval_dataset`, or saved), or None.

    Raises:
        ValueError: the validation data is one part per dataset (use `build_sft_eval_loaders`).
    """
    loaders = build_sft_eval_loaders(dataset_cfg, ctx)
    if loaders and MIXED_EVAL not in loaders:
        raise ValueError(
            "train_dataset.eval_on_each_dataset: the validation data is one part per dataset; "
            "build its loaders with build_eval_loaders"
        )
    return loaders.get(MIXED_EVAL)


def build_sft_eval_loaders(dataset_cfg: TrainDatasetConfig, ctx: LoaderContext) -> dict[str, EvalLoader]:
    """One `EvalLoader` per validation part (see `build_sft_parts`); empty without validation data."""
    from meshforge.data.loader import EvalLoader

    _, parts = _shared_data(dataset_cfg, ctx)
    return {
        name: EvalLoader(
            rows, local_batch_size=ctx.local_batch_size, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size
        )
        for name, rows in parts.items()
    }


__all__ = [
    "SFTDataset",
    "SFTStream",
    "build_sft_columns",
    "build_sft_data",
    "build_sft_dataset",
    "build_sft_eval_loader",
    "build_sft_eval_loaders",
    "build_sft_loader",
    "build_sft_parts",
    "build_sft_splits",
    "pad_rows",
    "split_validation",
]
