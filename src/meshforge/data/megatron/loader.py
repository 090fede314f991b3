"""`train_dataset.dataloader.type: BlendedMegatronDatasetDataLoader`: Megatron data through the loader.

Builds the train split of the blend (`blended.build_datasets`) and wraps it in the one
`StatefulLoader` every data kind uses, so DP sharding, checkpointed position and O(1) resume are the
same as for other data. The GPTDataset already fixes a shuffled order (its own seed), so with the
default `shuffle: False` the loader reads it in order: rank r of dp gets chunk r of each round of
`dp * local_batch_size` samples, as Megatron's MegatronPretrainingSampler does.

Train samples: `sizes[0]` when given and positive, else `total_steps * global_batch_size` (what
Megatron's `train_iters * global_batch_size` gives), else one epoch of the data. With
`training.epochs`, one epoch is the train split's own sample count (`epoch_samples`: for each
member, its train documents' tokens cut into seq_length samples, summed over the blend's members)
and the run's steps follow from it; the data is then built for `steps * global_batch_size`
samples, Megatron's way of asking for several epochs (its document index repeats the documents).

Raw files in `data_path` (parquet, arrow, csv, json, jsonl, txt, or a folder of them) are converted
to `.bin/.idx` first, once per run (`raw.py`), and then read as any prefix.

Validation (`build_megatron_eval_loader`): the split's second part (`split: '98,2,0'`), built with
Megatron's algorithm for the `valid` split (same cache names, seed, and sample order as
megatron-core). Its size is `sizes[1]` when given and positive; otherwise one pass over the
validation documents (a weighted blend draws that many samples by weight). Megatron itself sizes
it `(train_iters // eval_interval + 1) * eval_iters * global_batch` because its evaluations read on
through one iterator; here every evaluation starts again from the first validation sample, so
eval_loss values are comparable across the run (limit each evaluation with `max_batches`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from meshforge.data.epochs import steps_for_epochs
from meshforge.data.megatron.specs import COLUMN_NAMES, MegatronDataLoaderOptions
from meshforge.utils.resources import resolve_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.data.config import TrainDatasetConfig
    from meshforge.data.context import LoaderContext
    from meshforge.data.loader import EvalLoader, StatefulLoader
    from meshforge.data.megatron.blended import BlendedDataset
    from meshforge.data.megatron.gpt_dataset import GPTDataset


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


def epoch_samples(options: MegatronDataLoaderOptions, split_no: int = 0) -> int:
    """Samples in one epoch of split `split_no`: per member `(tokens - extra) // seq_length`, summed.

    Reads only the `.idx` headers (no index is built). Weights of a blend do not change it.
    """
    from meshforge.data.megatron.blended import parse_blend
    from meshforge.data.megatron.gpt_dataset import split_document_indices
    from meshforge.data.megatron.indexed import IndexedDataset

    cfg = options.config
    blend = parse_blend(cfg.data_path, "train_dataset.dataloader.config.data_path")
    extra = int(cfg.add_extra_token_to_sequence)
    total = 0
    for prefix in blend.prefixes:
        indexed = IndexedDataset(str(resolve_path(prefix)))
        docs = split_document_indices(len(indexed), cfg.split)[split_no]
        if docs is None:
            continue
        tokens = int(indexed.sequence_lengths[docs].sum(dtype=np.int64))
        total += max(0, (tokens - extra) // cfg.seq_length)
    return total


def build_megatron_dataset(
    options: MegatronDataLoaderOptions,
    *,
    tokenizer: PreTrainedTokenizerBase | None,
    seed: int,
    num_samples: int | None,
    rank: int = 0,
    barrier: Callable[[], None] | None = None,
    log: Callable[[str], None] | None = None,
    valid_samples: int | None = None,
    with_valid: bool = False,
    with_train: bool = True,
) -> tuple[GPTDataset | BlendedDataset | None, GPTDataset | BlendedDataset | None]:
    """(train, valid) datasets of the configured blend.

    valid is built only `with_valid` (else None), and is None when the split gives it 0; it holds
    `valid_samples` (or `sizes[1]`) samples, or one pass over its documents when neither is set.
    train is built only `with_train` (else None).
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
        only=(0,) * with_train + (1,) * with_valid,
    )
    if with_train and datasets[0] is None:
        raise ValueError(
            f"train_dataset.dataloader.config.split: {cfg.split!r} gives the train split no documents"
        )
    if log is not None:
        log(
            "Megatron data: "
            + (f"{len(datasets[0]):,} train samples, " if datasets[0] is not None else "")
            + (f"{len(datasets[1]):,} valid samples, " if datasets[1] is not None else "")
            + f"{cfg.seq_length} tokens each, eod id {eod}, split {cfg.split!r}"
        )
    return datasets[0], datasets[1]


def _eod_from_tokenizer(tokenizer: PreTrainedTokenizerBase | None) -> int:
    """The tokenizer's end-of-document id (`<|endoftext|>`, else eos_token), with the fix named on failure."""
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


def prepared_options(dataset_cfg: TrainDatasetConfig, ctx: LoaderContext) -> MegatronDataLoaderOptions:
    """The loader's options with raw files in `data_path` converted to prefixes (`raw.py`), once per run."""
    from meshforge.data.megatron.raw import prepare_data_path

    cached = ctx.shared.get("megatron_options")
    if isinstance(cached, MegatronDataLoaderOptions):
        return cached
    options = prepare_data_path(
        dataset_cfg.dataloader.options_as(MegatronDataLoaderOptions),
        ctx.tokenizer,
        log=ctx.log,
        per_node=dataset_cfg.no_shared_storage,
    )
    ctx.shared["megatron_options"] = options
    return options


def build_megatron_loader(dataset_cfg: TrainDatasetConfig, ctx: LoaderContext) -> StatefulLoader:
    """The train builder of `BlendedMegatronDatasetDataLoader` (registered in `meshforge.data.specs`).

    With `ctx.epochs`, the steps come from `epoch_samples` (and are stored in `loader.total_steps`);
    `ctx.total_steps` is then ignored.
    """
    from meshforge.data.loader import StatefulLoader

    options = prepared_options(dataset_cfg, ctx)
    check_columns(dataset_cfg.dataloader.column_names)
    global_batch = ctx.global_batch
    total_steps = ctx.total_steps
    planned = None
    if ctx.epochs is not None:
        if options.sizes and options.sizes[0] > 0:
            raise ValueError(
                "train_dataset.dataloader.sizes[0]: fixes the train samples, and training.epochs sets them "
                "from the data size; set only one of them"
            )
        per_epoch = epoch_samples(options)
        planned = steps_for_epochs(per_epoch, ctx.epochs, global_batch, dataset_cfg.drop_remainder)
        total_steps = planned
        ctx.say(
            f"Megatron data: training.epochs {ctx.epochs:g} x {per_epoch:,} samples per epoch = {planned:,} "
            f"steps of {global_batch} samples"
        )
    rank, barrier = _builder_rank_and_barrier(per_node=dataset_cfg.no_shared_storage)
    train, _ = build_megatron_dataset(
        options,
        tokenizer=ctx.tokenizer,
        seed=ctx.seed,
        num_samples=train_samples(options, total_steps, global_batch),
        rank=rank,
        barrier=barrier,
        log=ctx.log,
    )
    assert train is not None  # build_megatron_dataset raises when the split gives train nothing
    loader = StatefulLoader.for_run(train, ctx, dataset_cfg)
    loader.total_steps = planned
    return loader


def build_megatron_eval_loader(dataset_cfg: TrainDatasetConfig, ctx: LoaderContext) -> EvalLoader | None:
    """The `EvalLoader` of the split's validation part (see the module docstring), or None when the
    split gives it 0."""
    from meshforge.data.loader import EvalLoader
    from meshforge.data.megatron.blended import parse_blend
    from meshforge.data.megatron.gpt_dataset import parse_split

    options = prepared_options(dataset_cfg, ctx)
    check_columns(dataset_cfg.dataloader.column_names)
    if parse_split(options.config.split)[1] == 0:
        return None
    valid_samples = None
    if not (options.sizes and len(options.sizes) > 1 and options.sizes[1] > 0):
        weighted = parse_blend(options.config.data_path, "train_dataset.dataloader.config.data_path").weights
        if weighted is not None:
            valid_samples = epoch_samples(options, split_no=1)
    rank, barrier = _builder_rank_and_barrier(per_node=dataset_cfg.no_shared_storage)
    _, valid = build_megatron_dataset(
        options,
        tokenizer=ctx.tokenizer,
        seed=ctx.seed,
        num_samples=None,
        rank=rank,
        barrier=barrier,
        log=ctx.log,
        valid_samples=valid_samples,
        with_valid=True,
        with_train=False,
    )
    if valid is None or len(valid) == 0:
        raise ValueError(
            f"train_dataset.dataloader.config.split: {options.config.split!r} gives the validation split "
            "no samples; give it a larger share or set the second part to 0 (no evaluation)"
        )
    return EvalLoader(valid, local_batch_size=ctx.local_batch_size, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size)


def _builder_rank_and_barrier(*, per_node: bool) -> tuple[int, Callable[[], None] | None]:
    """The rank that decides who builds the index caches (0 builds), and the barrier after it.

    `train_dataset.no_shared_storage: true`: the first rank of every node builds its node's copy
    (node-local disks); otherwise the job's rank 0 builds for all, as Megatron does.
    """
    import torch.distributed as dist

    from meshforge.data.prepare import preparer_rank

    if dist.is_available() and dist.is_initialized():
        return preparer_rank(per_node=per_node), dist.barrier
    return 0, None
