"""`train_dataset.dataloader.type: BlendedMegatronDatasetDataLoader`: Megatron data through the loader.

Builds the train split of the blend (`blended.build_datasets`) and wraps it in the one
`StatefulLoader` every data kind uses, so DP sharding, checkpointed position and O(1) resume are the
same as for other data. The GPTDataset already fixes a shuffled order (its own seed), so with the
default `shuffle: False` the loader reads it in order: rank r of dp gets chunk r of each round of
`dp * local_batch_size` samples, as Megatron's MegatronPretrainingSampler does.

Train samples: `sizes[0]` when given and positive, else `total_steps * global_batch_size` (what
Megatron's `train_iters * global_batch_size` gives), else one epoch of the data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshforge.data.megatron.specs import COLUMN_NAMES, MegatronDataLoaderOptions
from meshforge.resources import resolve_path


def resolved_blend(data_path: list[str]) -> list[str]:
    """The blend list with every prefix resolved (meshforge:// or cwd-relative), weights kept."""
    from meshforge.data.megatron.blended import parse_blend

    blend = parse_blend(data_path, "train_dataset.dataloader.config.data_path")
    prefixes = [str(resolve_path(p)) for p in blend.prefixes]
    if blend.weights is None:
        return prefixes
    return [item for pair in zip(map(str, blend.weights), prefixes, strict=True) for item in pair]


def check_columns(column_names: list[str] | None) -> None:
    """Raise ValueError for a column this loader cannot produce (naming the key and the valid ones)."""
    for i, name in enumerate(column_names or []):
        if name not in COLUMN_NAMES:
            raise ValueError(
                f"train_dataset.dataloader.column_names[{i}]: {name!r} is not a Megatron dataset column "
                f"(valid: {', '.join(COLUMN_NAMES)})"
            )


def train_samples(
    options: MegatronDataLoaderOptions, total_steps: int | None, global_batch: int
) -> int | None:
    """Samples the train split is built for (see the module docstring); None = one epoch."""
    if options.sizes and options.sizes[0] > 0:
        return int(options.sizes[0])
    if total_steps is not None and total_steps > 0:
        return int(total_steps) * int(global_batch)
    return None


def build_megatron_dataset(
    options: MegatronDataLoaderOptions,
    *,
    tokenizer: Any,
    seed: int,
    num_samples: int | None,
    rank: int = 0,
    barrier: Callable[[], None] | None = None,
    log: Callable[[str], None] | None = None,
    valid_samples: int | None = None,
    with_valid: bool = False,
) -> tuple[Any, Any]:
    """(train, valid) datasets of the configured blend.

    valid is built only `with_valid` (else None), and is None when the split gives it 0; it holds
    `valid_samples` (or `sizes[1]`) samples, or one pass over its documents when neither is set.
    """
    from meshforge.data.megatron.blended import build_datasets
    from meshforge.data.megatron.gpt_dataset import GPTDatasetConfig

    cfg = options.config
    eod = cfg.eod
    if eod is None:
        eod = _eod_from_tokenizer(tokenizer)
    gpt_cfg = GPTDatasetConfig(
        seq_length=cfg.seq_length,
        seed=seed if cfg.seed is None else cfg.seed,
        eod=eod,
        pad=cfg.pad,
        reset_position_ids=cfg.reset_position_ids,
        reset_attention_mask=cfg.reset_attention_mask,
        eod_mask_loss=cfg.eod_mask_loss,
        create_attention_mask=cfg.create_attention_mask,
        create_compressed_eod_mask=cfg.create_compressed_eod_mask,
        eod_pad_length=cfg.eod_pad_length,
        add_extra_token_to_sequence=cfg.add_extra_token_to_sequence,
        path_to_cache=str(resolve_path(cfg.path_to_cache)) if cfg.path_to_cache else None,
    )
    sizes: list[int | None] = [num_samples, valid_samples, None]
    if options.sizes:
        given = list(options.sizes) + [0] * (3 - len(options.sizes))
        sizes = [num_samples, given[1] or valid_samples, given[2] or None]
    datasets = build_datasets(
        resolved_blend(cfg.data_path),
        cfg.split,
        sizes,
        gpt_cfg,
        rank=rank,
        barrier=barrier,
        log=log,
        key="train_dataset.dataloader.config.data_path",
        only=(0, 1) if with_valid else (0,),
    )
    if datasets[0] is None:
        raise ValueError(
            f"train_dataset.dataloader.config.split: {cfg.split!r} gives the train split no documents"
        )
    if log is not None:
        log(
            f"Megatron data: {len(datasets[0]):,} train samples of {cfg.seq_length} tokens, eod id {eod}, "
            f"split {cfg.split!r}"
            + (f", {len(datasets[1]):,} valid samples" if datasets[1] is not None else "")
        )
    return datasets[0], datasets[1]


def _eod_from_tokenizer(tokenizer: Any) -> int:
    """The issue's EOD rule (`<|endoftext|>`, else eos_token), with the fix named on failure."""
    from meshforge.data.tokenizer import EOD_TOKEN, eod_token_id

    if tokenizer is None:
        raise ValueError(
            "train_dataset.dataloader.config.eod: not set and no tokenizer to take it from; set eod"
        )
    try:
        return eod_token_id(tokenizer)
    except ValueError:
        raise ValueError(
            f"train_dataset.dataloader.config.eod: not set, and the tokenizer has neither {EOD_TOKEN!r} nor an "
            "eos_token; set eod to the id that ends each document in the .bin data"
        ) from None


def build_megatron_loader(
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
    """The `LoaderBuilder` of `BlendedMegatronDatasetDataLoader` (see `meshforge.data.build`)."""
    from meshforge.data.loader import StatefulLoader
    from meshforge.data.specs import parse_megatron_options

    options = parse_megatron_options(dict(getattr(dataset_cfg.dataloader, "model_extra", None) or {}))
    check_columns(getattr(dataset_cfg.dataloader, "column_names", None))
    global_batch = global_batch_size or dp_size * local_batch_size
    rank, barrier = _rank_and_barrier()
    train, _ = build_megatron_dataset(
        options,
        tokenizer=tokenizer,
        seed=seed,
        num_samples=train_samples(options, total_steps, global_batch),
        rank=rank,
        barrier=barrier,
        log=log,
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


def _rank_and_barrier() -> tuple[int, Callable[[], None] | None]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.barrier
    return 0, None
