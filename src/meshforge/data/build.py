"""Build the training and evaluation data loaders named by `train_dataset.dataloader.type`.

The builders come from the one loader registry (`data/specs.py`: per type, its options model and
its train and eval builders), called with the `train_dataset` section and one `LoaderContext`.
Every train builder returns a `StatefulLoader` (or, for streamed SFT data, a `StreamLoader` with
the same interface), the one iterator type the trainer knows (micro-batches,
`state_dict`/`load_state_dict`, `epoch`, `num_samples`, `total_steps`).

Evaluation: `build_eval_loader` returns an `EvalLoader` over the validation data of the same section
(SFT `val_size` / `eval_dataset`, the Megatron split's second part) or None when there is none; the
text loader has no validation data. The trainer iterates it with `for batch in loader:` at each
evaluation (every iteration starts from the first sample) and passes it to
`meshforge.train.evaluation.evaluate`. `build_eval_loaders` returns the same data as named loaders:
`{MIXED_EVAL: loader}` for one validation set, or one loader per evaluation dataset under its name
(SFT `eval_on_each_dataset`); the trainer evaluates each and logs their token-weighted mean too.

Run length by epochs (`training.epochs`, MindSpeed's num_train_epochs with max_steps -1): set
`ctx.epochs`; the loader's `total_steps` is then the number of optimizer steps (`steps_for_epochs`
of the dataset's sample count), which the trainer uses instead of `training.steps` (for the LR
schedule too). A builder that sizes its data by the run (Megatron) sets `total_steps` itself.
Streamed data has no length and refuses it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from meshforge.data.context import MIXED_EVAL, LoaderContext
from meshforge.data.epochs import steps_for_epochs
from meshforge.data.specs import LOADERS, check_dataloader_options

if TYPE_CHECKING:
    from meshforge.data.config import TrainDatasetConfig
    from meshforge.data.loader import EvalLoader, StatefulLoader, StreamLoader

__all__ = [
    "MIXED_EVAL",
    "LoaderContext",
    "build_eval_loader",
    "build_eval_loaders",
    "build_train_loader",
    "ignored_settings_note",
]

# train_dataset fields that tune MindSpore's multi-worker input pipeline; the in-memory loaders here
# have no worker pool, so an explicit value is reported rather than silently ignored.
PIPELINE_FIELDS = ("num_parallel_workers", "prefetch_size", "numa_enable", "use_distribute_dataset")
DEFAULT_COLUMNS = ["input_ids", "labels"]


def ignored_settings_note(dataset_cfg: TrainDatasetConfig) -> str | None:
    """One line naming explicitly set pipeline settings that have no effect on these loaders, or None."""
    explicit = dataset_cfg.model_fields_set
    # Zero workers is what these loaders do (MindSpeed's default, written by the importer).
    names = [
        f"train_dataset.{name}"
        for name in PIPELINE_FIELDS
        if name in explicit and not (name == "num_parallel_workers" and dataset_cfg.num_parallel_workers == 0)
    ]
    loader_cfg = dataset_cfg.dataloader
    if "python_multiprocessing" in loader_cfg.model_fields_set:
        names.append("train_dataset.dataloader.python_multiprocessing")
    kind = LOADERS.get(loader_cfg.type or "")
    if list(loader_cfg.column_names) != DEFAULT_COLUMNS and not (kind is not None and kind.column_aware):
        names.append("train_dataset.dataloader.column_names")
    if not names:
        return None
    return (
        f"note: {', '.join(names)} set but without effect: {loader_cfg.type} reads in-memory data in the "
        f"training process (no worker pool) and always yields the columns {', '.join(DEFAULT_COLUMNS)}"
    )


def build_train_loader(dataset_cfg: TrainDatasetConfig, ctx: LoaderContext) -> StatefulLoader | StreamLoader:
    """Build this rank's training loader from the `train_dataset` section.

    `ctx.total_steps` is passed on only when the run is not sized by `ctx.epochs`.

    Raises:
        ValueError: unknown or unbuilt loader type, invalid options (with their key paths), bad data.
        FileNotFoundError: a data path does not exist.
    """
    type_name = dataset_cfg.dataloader.type
    kind = LOADERS.get(type_name) if type_name is not None else None
    if kind is None:
        [(_, reason)] = check_dataloader_options(type_name, {})
        raise ValueError(f"train_dataset.dataloader.type: {reason}")
    note = ignored_settings_note(dataset_cfg)
    if note:
        ctx.say(note)
    if ctx.epochs is not None and ctx.total_steps is not None:
        ctx = replace(ctx, total_steps=None)
    loader = kind.train(dataset_cfg, ctx)
    if ctx.epochs is not None and loader.total_steps is None:
        num_samples = loader.num_samples
        if num_samples is None:
            raise ValueError(
                "training.epochs: the length of this data is not known in advance (streaming: true); "
                "set training.steps instead"
            )
        gbs = ctx.global_batch
        loader.total_steps = steps_for_epochs(num_samples, ctx.epochs, gbs, dataset_cfg.drop_remainder)
        ctx.say(
            f"data: training.epochs {ctx.epochs:g} x {num_samples:,} samples = {loader.total_steps:,} steps "
            f"of {gbs} samples"
        )
    return loader


def build_eval_loader(dataset_cfg: TrainDatasetConfig, ctx: LoaderContext) -> EvalLoader | None:
    """This rank's evaluation loader (`EvalLoader`) for the `train_dataset` section, or None.

    None when the configuration asks for no validation data: SFT without `val_size` or
    `eval_dataset` (and no saved validation part under `tokenized_path`), a Megatron `split` whose
    second part is 0, or a loader type without validation data (TextDataLoader). Pass the context
    of the train loader: the SFT builders share one pipeline run through it. `ctx.local_batch_size`
    is the rows per evaluation batch; the validation size depends neither on the global batch
    nor on the run length.

    Returns:
        An `EvalLoader` (`for batch in loader:` = one full pass from the start), or None.
    """
    kind = LOADERS.get(dataset_cfg.dataloader.type or "")
    if kind is None or kind.eval is None:
        return None
    return kind.eval(dataset_cfg, ctx)


def build_eval_loaders(dataset_cfg: TrainDatasetConfig, ctx: LoaderContext) -> dict[str, EvalLoader]:
    """This rank's evaluation loaders by name; empty when there is no validation data.

    One validation set is the one entry `MIXED_EVAL` (the loader of `build_eval_loader`); with
    SFT `eval_on_each_dataset` and `eval_dataset`, each dataset has its own loader under its name
    (a name from dataset_info.json, or the key path of an inline dataset), in the order given.
    """
    kind = LOADERS.get(dataset_cfg.dataloader.type or "")
    if kind is not None and kind.eval_each is not None:
        return kind.eval_each(dataset_cfg, ctx)
    loader = build_eval_loader(dataset_cfg, ctx)
    return {} if loader is None else {MIXED_EVAL: loader}
