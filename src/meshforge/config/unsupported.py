"""The one list of configuration keys whose features are not built yet.

`check_trainable` refuses a run that sets any of them (`not supported yet: <key path>`), and
`config validate` lists them as warnings, so nothing is silently ignored. When a feature lands,
delete its entry here. Every predicate is False for the default config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from pydantic import BaseModel

from meshforge.data.config import SFT_FIELDS, SFT_LOADER, TrainDatasetConfig
from meshforge.models.config import ModelConfig
from meshforge.parallel.config import (
    MS_TP_COLWISE,
    MS_TP_ROWWISE,
)
from meshforge.train.config import TrainingConfig

if TYPE_CHECKING:
    from meshforge.config.root import TrainConfig


class Unsupported(NamedTuple):
    """A feature that is configurable but not built: where, when it is on, and a short note."""

    path: str
    is_set: Callable[[TrainConfig], bool]
    note: str


def is_generic_model(cfg: TrainConfig) -> bool:
    """Whether ``cfg`` trains through the generic transformers path (no built-in family).

    True when the ``model:`` section names no family and ``model_name_or_path/config.json``
    names none that meshforge builds. Light: reads only the JSON file (no torch, no transformers).
    A folder that cannot be read counts as not generic (the model build reports it).
    """
    import json

    from meshforge.models.registry import resolve_family
    from meshforge.utils.resources import resolve_path

    model = cfg.model
    if not model.model_name_or_path or model.model_type or model.architectures or model.model_id:
        return False
    try:
        config = json.loads(
            (resolve_path(model.model_name_or_path) / "config.json").read_text(encoding="utf-8")
        )
        resolve_family(config.get("model_type"), config.get("architectures"))
    except ValueError as err:
        return "not supported yet" in str(err)
    except (OSError, AttributeError):
        return False
    return False


def _default(section: type[BaseModel], name: str) -> object:
    return section.model_fields[name].default


def _unbuilt_fields(
    path: str, section: type[BaseModel], note: str, *, skip: tuple[str, ...] = ()
) -> list[Unsupported]:
    """One entry per field of a section whose feature is not built: any non-default value is refused.

    A field such as `profiler.start_step` changes nothing while its section's feature is not built,
    so writing it alone is refused too, under its own key path.
    """

    def getter(cfg: TrainConfig, name: str) -> object:
        node: object = cfg
        for part in path.split("."):
            node = getattr(node, part)
        return getattr(node, name)

    def differs(name: str) -> Callable[[TrainConfig], bool]:
        return lambda cfg: getter(cfg, name) != _default(section, name)

    return [
        Unsupported(f"{path}.{name}", differs(name), note)
        for name in section.model_fields
        if name not in skip
    ]


def _model_differs(name: str) -> Callable[[TrainConfig], bool]:
    return lambda cfg: getattr(cfg.model, name) != _default(ModelConfig, name)


def _kernel_enabled(name: str) -> Callable[[TrainConfig], bool]:
    return lambda cfg: name in cfg.kernels.enabled()


def _written_false(cfg: TrainConfig, section: str, name: str) -> bool:
    node = getattr(cfg, section)
    return name in node.model_fields_set and getattr(node, name) is False


def _sft_default(name: str) -> object:
    return TrainDatasetConfig.model_fields[name].default


# SFT fields not built yet; the others are read by the SFTDataLoader (no_shared_storage by the
# Megatron loader too).
SFT_NOT_BUILT: tuple[str, ...] = ()


SFT_NOT_BUILT_NOTES: dict[str, str] = {}


def _sft_set(name: str, *, any_loader: bool) -> Callable[[TrainConfig], bool]:
    def is_set(cfg: TrainConfig) -> bool:
        if not any_loader and cfg.train_dataset.dataloader.type == SFT_LOADER:
            return False
        return getattr(cfg.train_dataset, name) != _sft_default(name)

    return is_set


def _sft_entries() -> list[Unsupported]:
    entries = []
    for name in SFT_FIELDS:
        if name == "dataloader_type":  # a single allowed value: nothing to refuse
            continue
        if name in ("eval_num_beams", "create_attention_mask_in_dataloader", "append_eod"):  # noops.py
            continue
        if name == "no_shared_storage":  # read by the SFT and the Megatron loaders alike
            continue
        if name in SFT_NOT_BUILT:
            is_set = _sft_set(name, any_loader=True)
            note = SFT_NOT_BUILT_NOTES.get(name, "SFT data pipeline: not built yet")
        else:
            # Built, but only the SFT loader reads it: set with another loader it would be ignored.
            is_set = _sft_set(name, any_loader=False)
            note = f"read only by train_dataset.dataloader.type: {SFT_LOADER}"
        entries.append(Unsupported(f"train_dataset.{name}", is_set, note))
    return entries


def _pref_field_set(name: str) -> Callable[[TrainConfig], bool]:
    return lambda cfg: (
        cfg.training.stage != "dpo" and getattr(cfg.training, name) != _default(TrainingConfig, name)
    )


# What the precomputed reference table (train/reference_table.py) does not combine with yet.
_PRECOMPUTE_REFUSED: list[tuple[Callable[[TrainConfig], bool], str, str]] = [
    (
        lambda c: c.train_dataset.streaming,
        "train_dataset.streaming",
        "the table is keyed by the row's place in in-memory data; a stream has none",
    ),
    (
        lambda c: c.parallelism.context_parallel > 1,
        "CP",
        "the table pass gives each data-parallel rank whole rows, not sequence shards",
    ),
    (
        lambda c: c.parallelism.pipeline_parallel > 1,
        "PP",
        "the table pass runs the reference forward outside the pipeline schedule",
    ),
    (
        lambda c: c.parallelism.fault_tolerance.enable,
        "torchft replica groups",
        "the table pass shards rows over one replica group's ranks, untested",
    ),
]


def _precompute_with(on: Callable[[TrainConfig], bool]) -> Callable[[TrainConfig], bool]:
    return lambda c: c.training.stage == "dpo" and c.training.pref_ref_logps == "precompute" and on(c)


# What preference training (train/preference.py) does not combine with yet (dp/FSDP, TP, EP, CP
# and PP are each tested equal to one process).
_DPO = "training.stage: dpo"
PREFERENCE_ENTRIES: list[Unsupported] = [
    *[
        Unsupported(
            f"training.{name}",
            _pref_field_set(name),
            "read only by training.stage: dpo (the preference loss)",
        )
        for name in (
            "pref_beta",
            "pref_loss",
            "pref_ftx",
            "dpo_label_smoothing",
            "simpo_gamma",
            "pref_ref_logps",
        )
    ],
    *[
        Unsupported(
            "training.pref_ref_logps",
            _precompute_with(on),
            f"{_DPO} with pref_ref_logps: precompute and {what}: {why}",
        )
        for on, what, why in _PRECOMPUTE_REFUSED
    ],
    Unsupported(
        "parallelism.fault_tolerance.enable",
        lambda c: c.training.stage == "dpo" and c.parallelism.fault_tolerance.enable,
        f"{_DPO} with torchft replica groups: the pair metrics are reduced within a group only, untested",
    ),
]


def _rm_parallel(name: str) -> Callable[[TrainConfig], bool]:
    return lambda cfg: cfg.training.stage == "rm" and getattr(cfg.parallelism, name) > 1


# What reward-model training (train/reward.py) does not combine with yet (dp/FSDP, TP, EP are tested).
_RM = "training.stage: rm"
REWARD_ENTRIES: list[Unsupported] = [
    *[
        Unsupported(f"parallelism.{name}", _rm_parallel(name), f"{_RM} with {what}: {why}")
        for name, what, why in (
            ("context_parallel", "CP", "a sequence's last token lies on one CP rank only; untested"),
            ("pipeline_parallel", "PP", "the pipeline's last stage computes the LM loss, not the value head"),
        )
    ],
    Unsupported(
        "parallelism.fault_tolerance.enable",
        lambda c: c.training.stage == "rm" and c.parallelism.fault_tolerance.enable,
        f"{_RM} with torchft replica groups: the pair metrics are reduced within a group only, untested",
    ),
]

_P = "parallelism"
ENTRIES: list[Unsupported] = [
    *PREFERENCE_ENTRIES,
    *REWARD_ENTRIES,
    Unsupported(
        f"{_P}.expert_parallel_async_d2h",
        lambda c: c.parallelism.expert_parallel_async_d2h,
        "asynchronous copy of expert token counts",
    ),
    Unsupported(f"{_P}.context_parallel_async", lambda c: c.parallelism.context_parallel_async, "async CP"),
    Unsupported(
        f"{_P}.pipeline_parallel_overlap_p2p",
        lambda c: c.parallelism.pipeline_parallel_overlap_p2p,
        "PP overlap",
    ),
    Unsupported(
        f"{_P}.pipeline_parallel_overlap_b_f",
        lambda c: c.parallelism.pipeline_parallel_overlap_b_f,
        "PP overlap",
    ),
    Unsupported(f"{_P}.enable_mc2", lambda c: c.parallelism.enable_mc2, "MC2 fused TP communication"),
    Unsupported(
        f"{_P}.data_parallel_shard_strategy",
        lambda c: c.parallelism.data_parallel_shard_strategy == "optim",
        "ZeRO-1 (optimizer-only) sharding: FSDP2 always shards the gradients",
    ),
    Unsupported(
        f"{_P}.tp_colwise",
        lambda c: c.parallelism.tp_colwise != MS_TP_COLWISE and not is_generic_model(c),
        "custom TP plan for built-in families (the generic transformers path honours it)",
    ),
    Unsupported(
        f"{_P}.tp_rowwise",
        lambda c: c.parallelism.tp_rowwise != MS_TP_ROWWISE and not is_generic_model(c),
        "custom TP plan for built-in families (the generic transformers path honours it)",
    ),
    Unsupported(
        f"{_P}.ep_dispatcher", lambda c: c.parallelism.ep_dispatcher != "eager", "fused/mc2 EP dispatch"
    ),
    *[
        Unsupported(
            f"model.{name}",
            _model_differs(name),
            "model hubs: models and tokenizers load from a local folder only",
        )
        for name in ("model_revision", "cache_dir", "hf_hub_token", "ms_hub_token", "om_hub_token")
    ],
    Unsupported(
        "training.indexer_loss_coeff",
        lambda c: c.training.indexer_loss_coeff != _default(TrainingConfig, "indexer_loss_coeff"),
        "the indexer loss of DeepSeek sparse attention (DSA, DeepSeek-V3.2 / GLM-5): no built family has "
        "a DSA indexer, so the coefficient would weigh nothing",
    ),
    Unsupported(
        f"{_P}.pipeline_parallel_p2p_transport",
        lambda c: c.parallelism.pipeline_parallel_p2p_transport != "plain",
        "PP transports other than plain send/recv",
    ),
    Unsupported(
        f"{_P}.pipeline_parallel_microbatch_size",
        lambda c: c.parallelism.pipeline_parallel_microbatch_size not in (1, c.training.local_batch_size),
        "a PP micro-batch other than training.local_batch_size rows (each schedule micro-batch is one "
        "local batch: set training.local_batch_size instead)",
    ),
    Unsupported(
        f"{_P}.sequence_parallel",
        lambda c: c.parallelism.tensor_parallel > 1 and _written_false(c, "parallelism", "sequence_parallel"),
        "tensor parallelism without sequence parallelism (SP is on whenever tensor_parallel > 1)",
    ),
    Unsupported(
        "checkpoint.load_worker_number", lambda c: c.checkpoint.load_worker_number != 1, "parallel loading"
    ),
    Unsupported(
        "checkpoint.reshard_worker_num", lambda c: c.checkpoint.reshard_worker_num != 1, "parallel resharding"
    ),
    # Built kernel switches live in meshforge.models.common.kernels; these belong to families not built.
    *[
        Unsupported(f"kernels.{name}", _kernel_enabled(name), "fused kernel")
        for name in (
            "use_triton_gdn",
            "use_flash_gdn",
            "use_triton_rmsnormgated",
            "use_ascend_mhc",
            "use_triton_swiglu_limit",
        )
    ],
    Unsupported(
        "checkpoint.remove_redundancy", lambda c: c.checkpoint.remove_redundancy, "redundancy-free saving"
    ),
    Unsupported(
        "checkpoint.save_epochs", lambda c: c.checkpoint.save_epochs is not None, "epoch-based saving"
    ),
    *_sft_entries(),
]


def unsupported_entries(cfg: TrainConfig) -> list[Unsupported]:
    """The entries whose feature `cfg` turns on."""
    return [entry for entry in ENTRIES if entry.is_set(cfg)]


def unsupported_features(cfg: TrainConfig) -> list[str]:
    """Key paths of features that `cfg` sets but that are not built yet (empty for the defaults)."""
    return [entry.path for entry in unsupported_entries(cfg)]
