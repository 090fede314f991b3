"""Build the training data loader named by `train_dataset.dataloader.type`.

A dict registry maps each loader type to a builder, so the Megatron and SFT loaders of later work plug
in with `register_loader` without touching the trainer. Every builder returns a `StatefulLoader`, the
one iterator type the trainer knows (micro-batches, `state_dict`/`load_state_dict`, `epoch`).
"""

from __future__ import annotations

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


def _build_megatron_loader(dataset_cfg: Any, **kwargs: Any) -> StatefulLoader:
    from meshforge.data.megatron.loader import build_megatron_loader

    return build_megatron_loader(dataset_cfg, **kwargs)


def _build_sft_loader(dataset_cfg: Any, **kwargs: Any) -> StatefulLoader:
    from meshforge.data.sft.loader import build_sft_loader

    return build_sft_loader(dataset_cfg, **kwargs)


LOADER_BUILDERS: dict[str, LoaderBuilder] = {
    "TextDataLoader": _build_text_loader,
    "BlendedMegatronDatasetDataLoader": _build_megatron_loader,
    "SFTDataLoader": _build_sft_loader,
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
    return builder(
        dataset_cfg,
        tokenizer=tokenizer,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        global_batch_size=global_batch_size,
        log=log,
        **({"total_steps": total_steps} if _accepts(builder, "total_steps") else {}),
    )


def _accepts(builder: Callable[..., Any], name: str) -> bool:
    # Builders registered before `total_steps` existed do not take it; only pass it to those that do.
    import inspect

    params = inspect.signature(builder).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
