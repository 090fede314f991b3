"""`meshforge data preview`: the first rows of a run's training data, exactly as the trainer reads them.

Users check templates, masks and packing here before spending compute, and tests use it to look at
what a config produces. Only the tokenizer and the data pipeline are built: no model weights, no
process group (a `model_name_or_path` folder holding only tokenizer files is enough). The loader is
the one `meshforge train` builds (`data.build.build_train_loader`) for one data-parallel rank with
`train_dataset.dataloader.shuffle` turned off, so row k is the k-th sample of the trainer's global
order with shuffling off; Megatron data is sized as the run sizes it (`training.steps` x global
batch), so its own shuffle index, which the run uses, is the same.

A row is one sample after processing and packing and before batching: text and Megatron samples are
`seq_length` tokens; an SFT row is its own length (the collator's padding to `cutoff_len` is a
batching step), except that a packed row keeps the padding packing gave it. Keys follow the batch
contract of DESIGN.md (`input_ids`, `labels` shifted so `labels[i]` is the target of position i with
-100 for no loss, `position_ids` / `segment_ids` when the data has them), plus `index` (the sample's
index in the dataset) and `text`.

`text` is the decoded `input_ids` (special tokens kept) with every span of tokens that are *not*
loss targets wrapped in `[MASKED]...[/MASKED]`. Token j is a loss target when `labels[j - 1]` is not
-100 (labels are shifted by one), so the first token of a row is always inside a masked span, and in
SFT data the prompt shows masked and the trained answer plain, as LLaMA-Factory's unshifted labels
read. The last label (the target of the token after the row) has no token in `text`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import IO, TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.config.root import TrainConfig
    from meshforge.data.config import TrainDatasetConfig
    from meshforge.data.loader import SampleSource, StatefulLoader, StreamLoader

IGNORE_INDEX = -100
MASK_OPEN = "[MASKED]"
MASK_CLOSE = "[/MASKED]"
ROW_KEYS = ("input_ids", "labels", "position_ids", "segment_ids")


def unshuffled(dataset_cfg: TrainDatasetConfig) -> TrainDatasetConfig:
    """A copy of the `train_dataset` section with `dataloader.shuffle` off (other settings kept)."""
    loader = dataset_cfg.dataloader.model_copy(update={"shuffle": False})
    return dataset_cfg.model_copy(update={"dataloader": loader})


def _tokenizer(cfg: TrainConfig) -> PreTrainedTokenizerBase:
    from meshforge.data.tokenizer import build_tokenizer

    model = cfg.model
    path = model.tokenizer_name_or_path or model.model_name_or_path
    if not path:
        raise ValueError(
            "model.tokenizer_name_or_path: no tokenizer given (a local Hugging Face tokenizer folder, "
            "e.g. meshforge://assets/tokenizer; a model_name_or_path folder with tokenizer files also works)"
        )
    return build_tokenizer(
        str(path), use_fast=bool(model.use_fast_tokenizer), trust_remote_code=bool(model.trust_remote_code)
    )


def _refuse_unbuilt_data_features(cfg: TrainConfig) -> None:
    """Refuse the train_dataset features `meshforge train` refuses, so a preview never shows data a run would not use."""
    from meshforge.config import ConfigError
    from meshforge.config.unsupported import unsupported_entries

    issues = [
        (e.path, f"not supported yet: {e.path} ({e.note})")
        for e in unsupported_entries(cfg)
        if e.path.startswith("train_dataset")
    ]
    if issues:
        raise ConfigError(issues)


def build_preview_loader(
    cfg: TrainConfig, *, log: Callable[[str], None] | None = None
) -> tuple[PreTrainedTokenizerBase, StatefulLoader | StreamLoader]:
    """The run's tokenizer and its rank-0 loader of a one-rank run with shuffling off.

    Args:
        cfg: the validated `TrainConfig`.
        log: receives the data summary lines of the loader.

    Returns:
        (tokenizer, StatefulLoader).

    Raises:
        ConfigError: a data feature that is not built yet.
        ValueError / FileNotFoundError: what the loader raises for bad options or data.
    """
    from meshforge.data.build import LoaderContext, build_train_loader

    _refuse_unbuilt_data_features(cfg)
    tokenizer = _tokenizer(cfg)
    training = cfg.training
    context = LoaderContext(
        tokenizer=tokenizer,
        local_batch_size=training.local_batch_size,
        dp_rank=0,
        dp_size=1,
        seed=training.seed,
        # the run's global batch on one rank, so the epoch is cut where the trainer cuts it
        global_batch_size=training.effective_global_batch_size(1),
        total_steps=training.steps,
        epochs=training.epochs,  # a run sized by epochs sizes Megatron data by them too
        log=log,
        pairwise=training.stage in ("dpo", "rm"),  # pair rows, as the run reads them
    )
    loader = build_train_loader(unshuffled(cfg.train_dataset), context)
    return tokenizer, loader


def not_trained(labels: np.ndarray) -> np.ndarray:
    """Per position of a row: True where the input token there is not a loss target.

    Token j is the target of position j - 1, so it is trained when `labels[j - 1] != -100`; the first
    token of a row is never a target of that row.
    """
    labels = np.asarray(labels)
    masked = np.ones(len(labels), dtype=bool)
    masked[1:] = labels[:-1] == IGNORE_INDEX
    return masked


def masked_text(tokenizer: PreTrainedTokenizerBase, input_ids: Iterable[int], labels: Iterable[int]) -> str:
    """Decode a row, wrapping each run of non-target tokens in `[MASKED]...[/MASKED]`."""
    ids = np.asarray(list(input_ids), dtype=np.int64)
    masked = not_trained(np.asarray(list(labels), dtype=np.int64))
    if len(ids) == 0:
        return ""
    # Decode whole runs, not single tokens, so multi-token characters come out intact.
    cuts = np.flatnonzero(np.diff(masked.astype(np.int8))) + 1
    parts: list[str] = []
    for start, end in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(ids)]]), strict=True):
        # One sequence of ids decodes to one string (a list only comes back for a batch).
        piece = cast(
            str,
            tokenizer.decode(
                ids[start:end].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False
            ),
        )
        parts.append(f"{MASK_OPEN}{piece}{MASK_CLOSE}" if masked[start] else piece)
    return "".join(parts)


@runtime_checkable
class _RowSource(Protocol):
    """A dataset that also gives one row unpadded (`SFTDataset`)."""

    def row(self, index: int) -> Mapping[str, np.ndarray]: ...


def _row_length(dataset: SampleSource, index: int, width: int) -> int:
    # SFT rows know their own length (packed ones include their padding); the batch pads the rest.
    if isinstance(dataset, _RowSource):
        return min(width, len(dataset.row(index)["input_ids"]))
    return width


def preview_rows(
    cfg: TrainConfig,
    num_samples: int,
    *,
    log: Callable[[str], None] | None = None,
    loader: tuple[PreTrainedTokenizerBase, StatefulLoader | StreamLoader] | None = None,
) -> list[dict[str, Any]]:
    """The first `num_samples` rows of the run's data, in the trainer's order with shuffling off.

    Args:
        cfg: the validated `TrainConfig`.
        num_samples: rows wanted; at most one epoch is returned (with shuffling off, the next epoch
            repeats the same rows), and `log` says so when fewer are available.
        log: receives the data summary lines and notes.
        loader: a (tokenizer, loader) pair from `build_preview_loader`, to reuse.

    Returns:
        One dict per row: `index`, `input_ids`, `labels`, `position_ids` / `segment_ids` when the data
        has them (lists of ints), and `text` (see the module docstring).

    Raises:
        ValueError: `num_samples` is not positive; or as `build_preview_loader`.
    """
    if num_samples <= 0:
        raise ValueError(f"--num-samples: must be a positive number of rows, got {num_samples}")
    tokenizer, data_loader = loader if loader is not None else build_preview_loader(cfg, log=log)
    from meshforge.data.loader import StatefulLoader

    if not isinstance(data_loader, StatefulLoader):
        return _rows_from_batches(data_loader, tokenizer, num_samples)
    dataset = data_loader.dataset
    per_epoch = data_loader.used_per_epoch
    count = min(num_samples, per_epoch)
    if count < num_samples and log is not None:
        log(
            f"note: the data has {per_epoch} row(s) per epoch (the trainer reads them again in the next "
            f"epoch); showing {count}"
        )
    rows = []
    # With shuffling off the loader's global order is 0, 1, 2, ... over the used part of the epoch.
    for index in range(count):
        batch = dataset.get_batch(np.asarray([index], dtype=np.int64))
        width = int(np.asarray(batch["input_ids"]).shape[1])
        length = _row_length(dataset, index, width)
        row: dict[str, Any] = {"index": index}
        for key in ROW_KEYS:
            if key in batch:
                row[key] = np.asarray(batch[key][0][:length], dtype=np.int64).tolist()
        row["text"] = masked_text(tokenizer, row["input_ids"], row["labels"])
        rows.append(row)
    return rows


def _rows_from_batches(
    data_loader: StreamLoader, tokenizer: PreTrainedTokenizerBase, num_samples: int
) -> list[dict[str, Any]]:
    """Rows of a loader without random access (a stream): its batches in order, split into rows.

    These rows keep the batch's padding (a stream cannot say where a row ended before batching).
    """
    rows: list[dict[str, Any]] = []
    for batch in data_loader:
        arrays = {key: np.asarray(value) for key, value in batch.items() if key in ROW_KEYS}
        for k in range(len(arrays["input_ids"])):
            row: dict[str, Any] = {"index": len(rows)}
            row.update({key: arrays[key][k].astype(np.int64).tolist() for key in ROW_KEYS if key in arrays})
            row["text"] = masked_text(tokenizer, row["input_ids"], row["labels"])
            rows.append(row)
            if len(rows) == num_samples:
                return rows
    return rows


def write_jsonl(rows: Iterable[dict[str, Any]], stream: IO[str]) -> None:
    """One JSON object per row and line (non-ASCII text kept as is)."""
    for row in rows:
        stream.write(json.dumps(row, ensure_ascii=False) + "\n")


def _summary(row: dict[str, Any]) -> str:
    labels = np.asarray(row["labels"])
    parts = [
        f"sample {row['index']}",
        f"{len(labels)} tokens",
        f"{int((labels != IGNORE_INDEX).sum())} with loss",
    ]
    if "segment_ids" in row:
        segments = np.asarray(row["segment_ids"])
        parts.append(f"{len(np.unique(segments[segments > 0]))} segment(s)")
        parts.append(f"{int((segments == 0).sum())} padding")
    elif "position_ids" in row:
        # an example starts where positions go 0, 1 (a pack's padding is a run of zeros)
        pos = np.asarray(row["position_ids"])
        starts = int(((pos[:-1] == 0) & (pos[1:] == 1)).sum())
        if starts > 1 or (pos[1:] == 0).any():
            parts.append(f"{starts} example(s)")
    return ", ".join(parts)


def print_rows(rows: Iterable[dict[str, Any]], stream: IO[str] | None = None) -> None:
    """Human-readable rows for a terminal: a header per row, masked spans dimmed (markers kept)."""
    from rich.console import Console
    from rich.rule import Rule
    from rich.text import Text

    console = Console(file=stream or sys.stdout, highlight=False)
    console.print(
        Text(
            f"{MASK_OPEN}...{MASK_CLOSE} (dim): tokens that are not loss targets (label -100)", style="italic"
        )
    )
    for k, row in enumerate(rows):
        console.print(Rule(f"row {k}: {_summary(row)}", align="left"))
        text = Text()
        rest = row["text"]
        while rest:
            start = rest.find(MASK_OPEN)
            end = rest.find(MASK_CLOSE, start + len(MASK_OPEN)) if start >= 0 else -1
            if start < 0 or end < 0:
                text.append(rest)
                break
            text.append(rest[:start])
            text.append(rest[start : end + len(MASK_CLOSE)], style="dim")
            rest = rest[end + len(MASK_CLOSE) :]
        console.print(text)


def run_preview(
    config: str | None,
    overrides: list[str],
    *,
    num_samples: int,
    output: str | None = None,
    fmt: str | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """`meshforge data preview`: load the config, build the data, write or print the rows.

    Args:
        config: YAML path (native or MindSpeed format); None is the built-in demo.
        overrides: `section.key=value` strings applied to the file.
        num_samples: rows to write.
        output: a .jsonl file to write; None prints to `stdout` (rich on a terminal, else JSON lines).
        fmt: "native", "mindspeed" or None (detect).

    Returns:
        The exit status: 0, or 2 for a config or data error (printed to `stderr`).
    """
    from pathlib import Path

    from meshforge.config import ConfigError, load_config
    from meshforge.utils.resources import builtin_config

    out = stdout or sys.stdout
    err = stderr or sys.stderr

    def say(line: str) -> None:
        print(line, file=err, flush=True)

    path = config if config is not None else str(builtin_config("demo"))
    try:
        cfg = load_config(path, overrides, fmt=fmt)
        rows = preview_rows(cfg, num_samples, log=say)
    except ConfigError as exc:
        print(str(exc), file=err)
        return 2
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=err)
        return 2
    if output is not None:
        target = Path(output)
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("w", encoding="utf-8") as f:
            write_jsonl(rows, f)
        say(f"wrote {len(rows)} row(s) to {target}")
    elif out.isatty():
        print_rows(rows, out)
    else:
        write_jsonl(rows, out)
    return 0
