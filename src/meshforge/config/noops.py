"""The one list of configuration keys that are accepted but change nothing where the run goes.

A key lands here when the reference system has it and writing it is harmless, but meshforge has
nothing for it to change: an Ascend-only knob on a CPU or CUDA run, a worker-pool setting for
loaders that run in the training process, a switch whose "off" value meshforge does not need.
`config validate` lists each one written with its note, and `meshforge train` logs the same
warning, so a written key is never silently ignored. Keys whose feature is not built yet are
refused instead (`config/unsupported.py`); keys that change the run have a reader
(`config/readers.py`). Every predicate is False for the default config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from pydantic import BaseModel

if TYPE_CHECKING:
    from meshforge.config.base import Issue
    from meshforge.config.root import TrainConfig


class NoOp(NamedTuple):
    """A key that has no effect on `device`: where, when it is written to no effect, and why."""

    path: str
    is_set: Callable[[TrainConfig, str], bool]
    note: str  # may name the device as `{device}`


def _written(cfg: TrainConfig, path: str) -> bool:
    """Whether the YAML (or an override) wrote the key at `path` (a default is never a no-op)."""
    *sections, leaf = path.split(".")
    node: object = cfg
    for name in sections:
        node = getattr(node, name)
    return isinstance(node, BaseModel) and leaf in node.model_fields_set


def _entry(path: str, note: str, *, devices: tuple[str, ...] | None = None) -> NoOp:
    """A no-op when written (on `devices` only, or everywhere when None)."""

    def is_set(cfg: TrainConfig, device: str) -> bool:
        return (devices is None or device in devices) and _written(cfg, path)

    return NoOp(path, is_set, note)


def _without_profiling(name: str) -> Callable[[TrainConfig, str], bool]:
    """A profiler field written while the profiler is off."""
    return lambda cfg, _device: not cfg.profiler.enable_profiling and _written(cfg, f"profiler.{name}")


def _without_quant(name: str) -> Callable[[TrainConfig, str], bool]:
    """A `model.quant_*` companion written while no recipe is set."""
    return lambda cfg, _device: cfg.model.quant_recipe_name is None and _written(cfg, f"model.{name}")


_NOT_NPU = ("cpu", "cuda")
_ASCEND = "Ascend-only setting, no effect on device {device!r}"
_NO_WORKERS = (
    "meshforge's loaders read in the training process and prefetch nothing in the background "
    "(no worker processes)"
)

ENTRIES: list[NoOp] = [
    _entry("context.max_device_memory", _ASCEND, devices=_NOT_NPU),
    _entry("parallelism.npu_nums_per_device", _ASCEND, devices=_NOT_NPU),
    _entry(
        "profiler.mstx",
        "step and phase markers are NVTX ranges on CUDA; no effect on device {device!r}",
        devices=("cpu", "npu"),
    ),
    _entry(
        "profiler.data_simplification",
        "an Ascend msprof export option: meshforge writes torch.profiler Chrome traces, which have no such mode",
    ),
    *[
        NoOp(
            f"profiler.{name}", _without_profiling(name), "no effect without profiler.enable_profiling: true"
        )
        for name in (
            "start_step",
            "end_step",
            "output_path",
            "profiler_rank",
            "profiler_level",
            "profile_memory",
            "profile_cpu",
            "with_stack",
            "record_shapes",
            "export_type",
        )
    ],
    NoOp(
        "parallelism.cpu_offload",
        lambda c, d: d == "cpu" and c.parallelism.cpu_offload,
        "no effect on cpu: parameters, gradients and optimizer state already live in host memory",
    ),
    # Zero workers is what the loaders do: MindSpeed's default `dataloader_num_workers: 0`, which
    # the importer writes, is no setting to warn about.
    NoOp(
        "train_dataset.num_parallel_workers",
        lambda c, d: (
            _written(c, "train_dataset.num_parallel_workers") and c.train_dataset.num_parallel_workers > 0
        ),
        _NO_WORKERS,
    ),
    *[
        _entry(f"train_dataset.{name}", _NO_WORKERS)
        for name in ("prefetch_size", "numa_enable", "persistent_workers")
    ],
    _entry("train_dataset.dataloader.python_multiprocessing", _NO_WORKERS),
    _entry(
        "train_dataset.use_distribute_dataset",
        "every loader already shards its samples over the data-parallel ranks",
    ),
    NoOp(
        "train_dataset.pin_memory",
        lambda c, d: d == "cpu" and _written(c, "train_dataset.pin_memory"),
        "no effect on cpu: batches stay in host memory (on an accelerator, true pins each batch "
        "before its asynchronous copy)",
    ),
    _entry(
        "model.init_model_with_meta_device",
        "meshforge always builds the model on the meta device and materialises it shard by shard",
    ),
    _entry(
        "training.calculate_per_token_loss",
        "meshforge always divides the summed loss by the global count of valid tokens (see "
        "parallelism.disable_gradient_division for the per-rank mean)",
    ),
    NoOp(
        "recompute_comm.enable",
        lambda c, d: c.recompute_comm.enable and not _gathers_sequence(c),
        "nothing is all-gathered to recompute: communication recompute needs "
        "parallelism.tensor_parallel > 1 on a built-in family (sequence parallelism)",
    ),
    _entry(
        "train_dataset.eval_num_beams",
        "evaluation during training measures the loss; the beams are those of `meshforge generate` "
        "(beam search on the eval prompts: `meshforge generate --prompts FILE.jsonl`)",
    ),
    _entry(
        "train_dataset.create_attention_mask_in_dataloader",
        "meshforge's batches carry segment_ids (and position_ids), and every model builds its causal "
        "block mask from them on the device; no [seq, seq] mask tensor is made or moved by the loader",
    ),
    _entry(
        "train_dataset.append_eod",
        "SFT examples end as their template ends each answer, and the packer knows where every "
        "example ends, so no EOD is appended to separate them; raw pretraining files get one with "
        "train_dataset.dataloader.config.append_eod (Megatron loader)",
    ),
    NoOp(
        "train_dataset.reset_attention_mask",
        lambda c, d: c.train_dataset.reset_attention_mask and not c.train_dataset.packing,
        "each row holds one example without train_dataset.packing: true, so there is nothing to "
        "separate (with packing, packed examples do not attend to each other, as with neat_packing)",
    ),
    NoOp(
        "train_dataset.eval_on_each_dataset",
        lambda c, d: c.train_dataset.eval_on_each_dataset and c.train_dataset.eval_dataset is None,
        "applies to the datasets of train_dataset.eval_dataset only: a val_size split is taken from the "
        "mixed training data, so it is one validation set (as in LLaMA-Factory)",
    ),
    NoOp(
        "checkpoint.load_balanced",
        lambda c, d: c.checkpoint.load_balanced,
        "DCP already reads in parallel on every rank, each rank only the chunks of its own shards; "
        "there is no one-rank read to balance",
    ),
    NoOp(
        "parallelism.expert_parallel_use_safe_tokens",
        lambda c, d: not c.parallelism.expert_parallel_use_safe_tokens,
        "meshforge's expert dispatch always handles experts that receive no tokens",
    ),
    *[
        NoOp(
            f"model.{name}",
            _without_quant(name),
            "no effect without model.quant_recipe_name (low-precision training is off)",
        )
        for name in (
            "quant_apply_modules",
            "quant_ignored_modules",
            "quant_converters",
            "enable_fsdp_low_precision_all_gather",
            "fsdp_low_precision_all_gather_mode",
        )
    ],
]


def _gathers_sequence(cfg: TrainConfig) -> bool:
    """Whether TP all-gathers sequence-split activations (SP; the generic path has none)."""
    from meshforge.config.unsupported import is_generic_model

    return cfg.parallelism.tensor_parallel > 1 and not is_generic_model(cfg)


def noop_entries(cfg: TrainConfig, device: str) -> list[NoOp]:
    """The entries that `cfg` writes to no effect on `device` (cpu, cuda, npu or auto)."""
    return [entry for entry in ENTRIES if entry.is_set(cfg, device)]


def noop_notes(cfg: TrainConfig, device: str) -> list[Issue]:
    """One `(key path, note)` warning per written no-op on `device`."""
    return [(entry.path, entry.note.format(device=device)) for entry in noop_entries(cfg, device)]
