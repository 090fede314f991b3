"""Build the training and evaluation data loaders named by `train_dataset.dataloader.type`.

A dict registry maps each loader type to a builder, so the Megatron and SFT loaders of later work plug
in with `register_loader` without touching the trainer. Every builder returns a `StatefulLoader` (or,
for streamed SFT data, a `StreamLoader` with the same interface), the one iterator type the trainer
knows (micro-batches, `state_dict`/`load_state_dict`, `epoch`, `num_samples`, `total_steps`).

Evaluation: `build_eval_loader` returns an `EvalLoader` over the validation data of the same section
(SFT `val_size` / `eval_dataset`, the Megatron split's second part) or None when there is none; the
text loader has no validation data. The trainer iterates it with `for batch in loader:` at each
evaluation (every iteration starts from the first sample) and passes it to
`meshforge.evaluation.evaluate`.

Run length by epochs (`training.epochs`, MindSpeed's num_train_epochs with max_steps -1): pass
`epochs` to `build_train_loader`; the loader's `total_steps` is then the number of optimizer steps
(`steps_for_epochs` of the dataset's sample count), which the trainer uses instead of
`training.steps` (for the LR schedule too). Streamed data has no length and refuses it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

from meshforge.data.loader import StatefulLoader
from meshforge.data.specs import BUILT_LOADERS, check_dataloader_options, parse_text_options

# train_dataset fields that tune MindSpore's multi-worker input pipeline; the in-memory loaders here
# have no worker pool, so an explicit value is reported rather than silently ignored.
PIPELINE_FIELDS = ("num_parallel_workers", "prefetch_size", "numa_enable", "use_distribute_dataset")
DEFAULT_COLUMNS = ["input_ids", "labels"]


class LoaderBuilder(Protocol):
    def __call__(
        self,
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
    ) -> StatefulLoader: ...


def _options(dataset_cfg: Any) -> dict:
    return dict(getattr(dataset_cfg.dataloader, "model_extra", None) or {})


def _build_text_loader(
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
) -> StatefulLoader:
    # Imported here so `meshforge.data.build` stays cheap to import for other loader types.
    from meshforge.data.text import TextDataset

    options = parse_text_options(_options(dataset_cfg))
    dataset = TextDataset.from_options(options, tokenizer, log=log)
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


def _build_megatron_loader(dataset_cfg: Any, *, epochs: float | None = None, **kwargs: Any) -> StatefulLoader:
    # Megatron data is sized by the run length, so it takes `epochs` itself (see build_train_loader).
    from meshforge.data.megatron.loader import build_megatron_loader

    return build_megatron_loader(dataset_cfg, epochs=epochs, **kwargs)


def _build_sft_loader(dataset_cfg: Any, **kwargs: Any) -> StatefulLoader:
    from meshforge.data.sft.loader import build_sft_loader

    return build_sft_loader(dataset_cfg, **kwargs)


def _build_megatron_eval_loader(dataset_cfg: Any, **kwargs: Any) -> Any:
    from meshforge.data.megatron.loader import build_megatron_eval_loader

    return build_megatron_eval_loader(dataset_cfg, **kwargs)


def _build_sft_eval_loader(dataset_cfg: Any, **kwargs: Any) -> Any:
    from meshforge.data.sft.loader import build_sft_eval_loader

    return build_sft_eval_loader(dataset_cfg, **kwargs)


LOADER_BUILDERS: dict[str, LoaderBuilder] = {
    "TextDataLoader": _build_text_loader,
    "BlendedMegatronDatasetDataLoader": _build_megatron_loader,
    "SFTDataLoader": _build_sft_loader,
}
# Builders of the evaluation loader, same keyword arguments as LoaderBuilder; a type without one
# (TextDataLoader) has no validation data.
EVAL_BUILDERS: dict[str, Callable[..., Any]] = {
    "BlendedMegatronDatasetDataLoader": _build_megatron_eval_loader,
    "SFTDataLoader": _build_sft_eval_loader,
}
# Loaders that read train_dataset.dataloader.column_names themselves (the note below skips them).
COLUMN_AWARE_LOADERS = {"BlendedMegatronDatasetDataLoader"}


def register_loader(type_name: str, builder: LoaderBuilder) -> None:
    """Make `train_dataset.dataloader.type: <type_name>` build with `builder`."""
    LOADER_BUILDERS[type_name] = builder


def ignored_settings_note(dataset_cfg: Any) -> str | None:
    """One line naming explicitly set pipeline settings that have no effect on these loaders, or None."""
    explicit = getattr(dataset_cfg, "model_fields_set", set())
    names = [f"train_dataset.{name}" for name in PIPELINE_FIELDS if name in explicit]
    loader_cfg = dataset_cfg.dataloader
    if "python_multiprocessing" in getattr(loader_cfg, "model_fields_set", set()):
        names.append("train_dataset.dataloader.python_multiprocessing")
    columns = getattr(loader_cfg, "column_names", None)
    if (
        columns is not None
        and list(columns) != DEFAULT_COLUMNS
        and loader_cfg.type not in COLUMN_AWARE_LOADERS
    ):
        names.append("train_dataset.dataloader.column_names")
    if not names:
        return None
    return (
        f"note: {', '.join(names)} set but without effect: {loader_cfg.type} reads in-memory data in the "
        f"training process (no worker pool) and always yields the columns {', '.join(DEFAULT_COLUMNS)}"
    )


def build_train_loader(
    dataset_cfg: Any,
    *,
    tokenizer: Any,
    local_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    global_batch_size: int | None = None,
    log: Callable[[str], None] | None = None,
    total_steps: int | None = None,
    epochs: float | None = None,
) -> StatefulLoader:
    """Build this rank's training loader from the `train_dataset` section.

    Args:
        dataset_cfg: the `train_dataset` section (`TrainDatasetConfig`).
        tokenizer: the run's Hugging Face tokenizer.
        local_batch_size: samples per micro-batch on this rank (`training.local_batch_size`).
        dp_rank, dp_size: position on the data-parallel ("batch") mesh axis.
        seed: `training.seed`; the sample order depends only on it and the epoch.
        global_batch_size: samples per optimizer step over all ranks; pass it so that epochs are
            rounded to whole steps and a step never mixes epochs (see `StatefulLoader`).
        log: receives the data summary and notes (pass the rank-0 logger).
        total_steps: optimizer steps of the run; loaders that size their data by it (Megatron:
            train samples = steps x global batch) use it.
        epochs: `training.epochs`: size the run by the data instead; the returned loader's
            `total_steps` holds the resulting number of optimizer steps (`total_steps` is ignored).

    Raises:
        ValueError: unknown or unbuilt loader type, invalid options (with their key paths), bad data.
        FileNotFoundError: a data path does not exist.
    """
    type_name = dataset_cfg.dataloader.type
    builder = LOADER_BUILDERS.get(type_name) if type_name is not None else None
    if builder is None:
        issues = check_dataloader_options(type_name, _options(dataset_cfg))
        reason = (
            issues[0][1] if issues else f"no builder registered; built loaders: {', '.join(BUILT_LOADERS)}"
        )
        raise ValueError(f"train_dataset.dataloader.type: {reason}")
    note = ignored_settings_note(dataset_cfg)
    if note and log is not None:
        log(note)
    extra: dict[str, Any] = {}
    if _accepts(builder, "total_steps"):
        extra["total_steps"] = None if epochs is not None else total_steps
    if epochs is not None and _accepts(builder, "epochs", var_keyword=False):
        extra["epochs"] = epochs  # the builder sizes its data by epochs and sets loader.total_steps
    loader = builder(
        dataset_cfg,
        tokenizer=tokenizer,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        global_batch_size=global_batch_size,
        log=log,
        **extra,
    )
    if epochs is not None and getattr(loader, "total_steps", None) is None:
        num_samples = getattr(loader, "num_samples", None)
        if num_samples is None:
            raise ValueError(
                "training.epochs: the length of this data is not known in advance (streaming: true); "
                "set training.steps instead"
            )
        gbs = global_batch_size or dp_size * local_batch_size
        loader.total_steps = steps_for_epochs(num_samples, epochs, gbs, bool(dataset_cfg.drop_remainder))
        if log is not None:
            log(
                f"data: training.epochs {epochs:g} x {num_samples:,} samples = {loader.total_steps:,} steps "
                f"of {gbs} samples"
            )
    return loader


def build_eval_loader(
    dataset_cfg: Any,
    *,
    tokenizer: Any,
    local_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    global_batch_size: int | None = None,
    total_steps: int | None = None,
    log: Callable[[str], None] | None = None,
) -> Any:
    """This rank's evaluation loader (`EvalLoader`) for the `train_dataset` section, or None.

    None when the configuration asks for no validation data: SFT without `val_size` or
    `eval_dataset` (and no saved validation part under `tokenized_path`), a Megatron `split` whose
    second part is 0, or a loader type without validation data (TextDataLoader). Build it after the
    train loader: the SFT builders share one pipeline run (same `dataset_cfg` and tokenizer objects).

    Args:
        dataset_cfg, tokenizer, dp_rank, dp_size, seed, log: as `build_train_loader`.
        local_batch_size: rows per evaluation batch on this rank.
        global_batch_size, total_steps: accepted for symmetry with the train loader; the
            validation size does not depend on them (see `meshforge.data.megatron.loader`).

    Returns:
        An `EvalLoader` (`for batch in loader:` = one full pass from the start), or None.
    """
    del global_batch_size, total_steps  # the validation data does not depend on the run length
    builder = EVAL_BUILDERS.get(dataset_cfg.dataloader.type or "")
    if builder is None:
        return None
    return builder(
        dataset_cfg,
        tokenizer=tokenizer,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        log=log,
    )


def steps_for_epochs(num_samples: int, epochs: float, global_batch_size: int, drop_remainder: bool) -> int:
    """Optimizer steps of `epochs` passes over `num_samples` samples, `global_batch_size` per step.

    With `drop_remainder` an epoch is `num_samples // global_batch_size` steps (the loader never
    lets a step span two epochs) and the run `ceil(epochs * that)` steps, as Hugging Face's Trainer
    counts `num_train_epochs`; without it the epochs are read back to back, `ceil(epochs *
    num_samples / global_batch_size)` steps.

    Raises:
        ValueError: no whole step (the data is smaller than one global batch, or epochs too small).
    """
    if num_samples <= 0 or global_batch_size <= 0 or epochs <= 0:
        raise ValueError(
            f"training.epochs: need positive samples, batch and epochs, got {num_samples}, "
            f"{global_batch_size}, {epochs}"
        )
    if drop_remainder:
        per_epoch = num_samples // global_batch_size
        if per_epoch == 0:
            raise ValueError(
                f"training.epochs: the data has {num_samples} samples, fewer than one global batch "
                f"({global_batch_size}); add data or lower training.global_batch_size"
            )
        # Rounded first so that e.g. 0.1 * 30 (3.0000000000000004) gives 3 steps, not 4.
        return max(1, math.ceil(round(epochs * per_epoch, 6)))
    return max(1, math.ceil(round(epochs * num_samples / global_batch_size, 6)))


def _accepts(builder: Callable[..., Any], name: str, *, var_keyword: bool = True) -> bool:
    # Builders registered before `total_steps` existed do not take it; only pass it to those that do.
    import inspect

    params = inspect.signature(builder).parameters.values()
    return any(p.name == name or (var_keyword and p.kind is inspect.Parameter.VAR_KEYWORD) for p in params)
