"""Import MindSpeed-LLM FSDP2 arguments (flat or grouped YAML) into the native sectioned format.

MindSpeed YAML groups keys under `model:/data:/parallel:/training:/optimization:` (`inference:`
for generation) or writes them flat. Each key is mapped to its native path, and a line per key
reports what it became. A MindSpeed argument that meshforge does not build (`mindspeed_args` has
the full list) answers `not supported yet` unless it is at MindSpeed's default; only a name outside
that list is an unknown key, with a suggestion (MindSpeed itself only logs them). Booleans are read
as MindSpeed reads them (1/0 too; `mindspeed_checks`). MindSpeed defaults that differ from
meshforge's are written into the result when they change what a run does, so a migrated file means
what it meant.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar, cast

from meshforge.config import mindspeed_checks
from meshforge.config.base import ConfigError, Issue, suggest
from meshforge.config.importer_training import (
    Choice,
    Flat,
    Say,
    To,
    training,
)
from meshforge.config.mindspeed_args import BY_NAME
from meshforge.config.mindspeed_checks import Origins
from meshforge.config.recompute_import import megatron_recompute
from meshforge.data.config import SFT_FIELDS

T = TypeVar("T")

GROUPS = ("model", "data", "parallel", "training", "optimization", "inference")

MODEL_KEYS = (
    "model_name_or_path",
    "model_id",
    "init_model_with_meta_device",
    "trust_remote_code",
    "train_from_scratch",
    "tokenizer_name_or_path",
    "cache_dir",
    "use_fast_tokenizer",
    "resize_vocab",
    "split_special_tokens",
    "add_tokens",
    "add_special_tokens",
    "new_special_tokens_config",
    "init_special_tokens",
    "model_revision",
    "hf_hub_token",
    "ms_hub_token",
    "om_hub_token",
    "quant_recipe_name",
    "quant_apply_modules",
    "quant_ignored_modules",
    "quant_converters",
    "enable_fsdp_low_precision_all_gather",
    "fsdp_low_precision_all_gather_mode",
)
# The SFT fields live under `train_dataset` with their MindSpeed names; two more keys pick the
# pretraining loader and its split.
DATA_KEYS = (*SFT_FIELDS, "data_manager_type", "split")
PARALLEL_KEYS = (
    "tp_size",
    "fsdp_size",
    "recompute",
    "ep_size",
    "ep_fsdp_size",
    "cp_size",
    "cp_type",
    "fsdp_modules",
    "ignored_modules",
    "reshard_after_forward",
    "shard_placement_fn",
    "efsdp_shard_placement_fn",
    "hook_modules",
    "fsdp_implementation",
    "tp_colwise",
    "tp_rowwise",
    "ep_modules",
    "ep_fsdp_modules",
    "ep_dispatcher",
    "recompute_modules",
    # Megatron-LM's flags (--recompute-granularity ...), by their argument names.
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "param_dtype",
    "reduce_dtype",
    "num_to_forward_prefetch",
    "num_to_backward_prefetch",
    "enable_chunk_batch",
    "chunk_mbs",
    "chunk_mbs_batch_dim",
    "chunk_mbs_modules",
    "chunk_mbs_arg_indexs",
    "chunk_mbs_kwarg_names",
)
TRAINING_KEYS = (
    "output_dir",
    "deterministic",
    "optimizer",
    "lr",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "lr_scheduler_type",
    "warmup_ratio",
    "min_lr",
    "num_train_epochs",
    "max_steps",
    "gradient_accumulation_steps",
    "disable_shuffling",
    "seed",
    "indexer_loss_coeff",
    "router_aux_loss_coef",
    "save_steps",
    "save_total_limit",
    "resume_from_checkpoint",
    "logging_steps",
    "log_throughput",
    "log_cpu_memory",
    "mtp_loss_scaling_factor",
    "stage",
    "calculate_per_token_loss",
    "dataloader_num_workers",
    "dataloader_prefetch_factor",
    "dataloader_pin_memory",
    "dataloader_persistent_workers",
    "dataloader_drop_last",
    "per_device_train_batch_size",
    "save_only_model",
    "save_async",
    "save_epochs",
    "save_hf_weights",
    "profile",
    "profile_step_start",
    "profile_step_end",
    "profile_ranks",
    "profile_level",
    "profile_export_type",
    "profile_data_simplification",
    "profile_with_cpu",
    "profile_with_stack",
    "profile_with_memory",
    "profile_record_shapes",
    "profile_save_path",
)
OPTIMIZATION_KEYS = (
    "use_fused_rmsnorm",
    "moe_grouped_gemm",
    "use_fused_rotary_pos_emb",
    "use_flash_attn",
    "use_triton_gdn",
    "use_flash_gdn",
    "chunk_loss_size",
    "gdn_chunk_size",
    "use_triton_rmsnormgated",
    "fix_router",
    "pre_tokens",
    "next_tokens",
    "use_ascend_mhc",
    "use_triton_swiglu_limit",
)
INFERENCE_KEYS = ("infer_backend", "max_new_tokens", "do_sample")

KEYS_BY_GROUP: dict[str, tuple[str, ...]] = {
    "model": MODEL_KEYS,
    "data": DATA_KEYS,
    "parallel": PARALLEL_KEYS,
    "training": TRAINING_KEYS,
    "optimization": OPTIMIZATION_KEYS,
    "inference": INFERENCE_KEYS,
}
ALL_KEYS: dict[str, str] = {key: group for group, keys in KEYS_BY_GROUP.items() for key in keys}

LOADERS = {"mg": "BlendedMegatronDatasetDataLoader", "lf": "SFTDataLoader"}
# The stage each data manager serves; MindSpeed's data factory refuses any other pair.
DATA_MANAGER_STAGE = {"lf": "sft", "mg": "pt"}
# MindSpeed data keys that the Megatron loader reads under its own config with data_manager_type mg
# (the first six are what MindSpeed's mg manager reads; tokenized_path and preprocessing_num_workers
# also steer meshforge's conversion of raw files). Other data keys have no effect with mg, in
# MindSpeed as here, and are reported as such.
MEGATRON_DATA_KEYS = frozenset(
    {
        "dataset",
        "cutoff_len",
        "create_attention_mask_in_dataloader",
        "reset_attention_mask",
        "append_eod",
        "overwrite_cache",
        "tokenized_path",
        "preprocessing_num_workers",
    }
)
CP_METHODS = {"ulysses": "ulysses", "ring": "colossal", "kvallgather": "kvallgather"}

# MindSpeed defaults that change what a run does relative to meshforge's: applied when absent.
MS_DEFAULTS: dict[str, object] = {
    "deterministic": True,
    "lr_scheduler_type": "cosine",
    "warmup_ratio": 0.03,
    "min_lr": 1e-6,
    "per_device_train_batch_size": 8,
    "save_steps": 500,
    "save_total_limit": 3,
    "disable_shuffling": False,
    "dataloader_drop_last": False,
    "dataloader_num_workers": 0,
    "data_manager_type": "lf",
    "stage": "sft",
    "param_dtype": "bf16",
    "cutoff_len": 2048,
    "max_steps": -1,
    "num_train_epochs": 3.0,
    # global batch = dp x per_device_train_batch_size x accumulation, as in MindSpeed.
    "gradient_accumulation_steps": 1,
}


def flatten(raw: dict[str, object], say: Say | None = None) -> tuple[Flat, list[Issue]]:
    """Flatten grouped MindSpeed YAML into {key: value}.

    Names outside MindSpeed's argument list become issues with a suggestion; MindSpeed arguments
    that meshforge does not map are logged at their default and issues otherwise.
    """
    flat: Flat = {}
    issues: list[Issue] = []
    where: dict[str, str] = {}
    tell = say or (lambda _line: None)

    def put(key: str, value: object, path: str) -> None:
        if key not in ALL_KEYS:
            if key in BY_NAME:
                issue = mindspeed_checks.unbuilt_argument(path, key, value, tell)
                if issue is not None:
                    issues.append(issue)
                return
            guess = suggest(key, list(BY_NAME) + list(GROUPS))
            hint = f"; did you mean {guess!r}?" if guess else ""
            issues.append((path, f"unknown MindSpeed argument {key!r}{hint}"))
            return
        if key in flat:
            issues.append((path, f"{key!r} is also given at {where[key]}"))
            return
        flat[key] = value
        where[key] = path

    for key, value in raw.items():
        key = str(key)
        if key in GROUPS and isinstance(value, dict):
            for sub, sub_value in value.items():
                sub = str(sub)
                expected = BY_NAME[sub].group if sub in BY_NAME else ALL_KEYS.get(sub)
                if expected is not None and expected != key:
                    issues.append(
                        (
                            f"{key}.{sub}",
                            f"belongs to the {expected!r} group of MindSpeed arguments, not {key!r}",
                        )
                    )
                    continue
                put(sub, sub_value, f"{key}.{sub}")
        elif key in GROUPS and value is None:
            continue
        else:
            put(key, value, key)
    return flat, issues


def _set(native: dict[str, object], path: str, value: object) -> None:
    node = native
    parts = path.split(".")
    for part in parts[:-1]:
        # `native` is written only here, and a native path is never also a prefix of another,
        # so an inner node is always one of the dicts made by this line.
        node = cast("dict[str, object]", node.setdefault(part, {}))
    node[parts[-1]] = value


def _comma_list(value: object) -> object:
    if isinstance(value, str) and "," in value:
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def import_mindspeed(
    raw: dict[str, object],
    log: Callable[[str], None] | None = None,
    origins: Origins | None = None,
) -> dict[str, object]:
    """Map a MindSpeed-format config to a native config dict.

    Args:
        raw: the parsed YAML (flat keys, groups, or both).
        log: receives one line per key: `<MindSpeed key> -> <native path> = <value>`, or why the
            key needs no native value.
        origins: filled with native path -> (MindSpeed key, value), so that validation errors can
            name the MindSpeed key (`mindspeed_checks.explain_choices`).

    Raises:
        ConfigError: unknown keys (with a suggestion), keys in the wrong group, bad enum values,
            arguments or model families that are not built (`not supported yet`).
    """
    say = log or (lambda _line: None)
    flat, issues = flatten(raw, say)
    mindspeed_checks.coerce_booleans(flat, say, issues)
    if "model_id" in flat:
        family = mindspeed_checks.model_family_issue(flat["model_id"], bool(flat.get("model_name_or_path")))
        if family is not None:
            issues.append(family)
    native: dict[str, object] = {}
    given = dict(flat)
    where = origins if origins is not None else {}
    for key, value in MS_DEFAULTS.items():
        if key not in flat:
            flat[key] = value

    def to(path: str, value: object, key: str) -> None:
        _set(native, path, value)
        where[path] = (key, flat.get(key, value))
        origin = "" if key in given else " (MindSpeed default)"
        say(f"{key} -> {path} = {value!r}{origin}")

    def choice(key: str, table: Mapping[str, T]) -> T | None:
        value = flat[key]
        if value not in table:
            issues.append((key, f"must be one of {sorted(table)}, got {value!r}"))
            return None
        return table[cast(str, value)]  # found among the table's str keys

    for key in MODEL_KEYS:
        if key in flat:
            to(f"model.{key}", flat[key], key)

    loader = choice("data_manager_type", LOADERS)
    if loader:
        to("train_dataset.dataloader.type", loader, "data_manager_type")
    megatron = flat["data_manager_type"] == "mg"
    manager = flat["data_manager_type"]
    pair = DATA_MANAGER_STAGE.get(manager) if isinstance(manager, str) else None
    if pair is not None and flat["stage"] != pair:
        key = "stage" if "stage" in given else "data_manager_type"
        issues.append(
            (
                key,
                f"data_manager_type {flat['data_manager_type']!r} needs stage {pair!r}, got stage "
                f"{flat['stage']!r} (MindSpeed accepts only the pairs (sft, lf) and (pt, mg))",
            )
        )
    if megatron:
        _megatron_flags(flat, given, to, say, issues)
    for key in DATA_KEYS:
        if key not in flat or key == "data_manager_type":
            continue
        value = flat[key]
        if megatron and key in MEGATRON_DATA_KEYS:
            continue  # placed by _megatron_flags
        if megatron and key != "split":
            say(
                f"{key} = {value!r} -> no effect with data_manager_type 'mg' (MindSpeed's mg manager does not read it)"
            )
            continue
        if key == "split":
            if megatron:
                to("train_dataset.dataloader.config.split", value, key)
            elif key in given:
                issues.append((key, "only used by data_manager_type 'mg' (Megatron data)"))
        else:
            to(f"train_dataset.{key}", value, key)

    _parallel(flat, given, to, choice, say, issues)
    training(flat, given, to, choice, say, issues)

    for key in OPTIMIZATION_KEYS:
        if key in flat:
            to(f"kernels.{key}", flat[key], key)
    for key in INFERENCE_KEYS:
        if key in flat:
            to(f"inference.{key}", flat[key], key)
    if issues:
        raise ConfigError(issues)
    return native


def _megatron_dataset(value: object, issues: list[Issue]) -> object:
    """MindSpeed's mg `dataset`: a path string (comma list) or `{file_name: <path, comma list or list>}`."""
    if isinstance(value, dict):
        extra = sorted(str(k) for k in value if k != "file_name")
        if extra or "file_name" not in value:
            issues.append(
                (
                    "dataset",
                    "with data_manager_type 'mg' the dataset is {file_name: <raw file, folder, .bin/.idx "
                    f"prefix, or a comma list of them>}}; got the keys {sorted(map(str, value))}",
                )
            )
            return value
        value = value["file_name"]
    return _comma_list(value)


def _megatron_flags(flat: Flat, given: Flat, to: To, say: Say, issues: list[Issue]) -> None:
    """`data_manager_type: mg`: the data keys the Megatron GPTDataset reads go to its own config.

    The native Megatron loader reads `train_dataset.dataloader.config.*` (data/megatron/specs.py);
    the `train_dataset.*` fields of the same names belong to the SFT loader and would be refused
    there. Raw files in `dataset` are converted to .bin/.idx by the loader (`data/megatron/raw.py`)
    with `append_eod`, `overwrite_cache`, `tokenized_path` and `preprocessing_num_workers`.
    """
    data = "train_dataset.dataloader.config"
    if "dataset" in flat:
        to(f"{data}.data_path", _megatron_dataset(flat["dataset"], issues), "dataset")
    for key in ("append_eod", "overwrite_cache", "tokenized_path", "preprocessing_num_workers"):
        if key in given and flat[key] is not None:
            to(f"{data}.{key}", flat[key], key)
    if "cutoff_len" in flat:
        to(f"{data}.seq_length", flat["cutoff_len"], "cutoff_len")
    if "create_attention_mask_in_dataloader" in flat:
        to(
            f"{data}.create_attention_mask",
            flat["create_attention_mask_in_dataloader"],
            "create_attention_mask_in_dataloader",
        )
    reset = flat.get("reset_attention_mask", False)
    append = flat.get("append_eod", False)
    if "reset_attention_mask" in flat:
        # MindSpeed passes actual_seq_len (documents split at EOD) and keeps positions running
        # (reset_position_ids is hard-coded False in its mg manager); meshforge's equivalent is
        # segment_ids from the GPTDataset, which also works at any local batch size.
        to(f"{data}.reset_attention_mask", reset, "reset_attention_mask")
    if reset is True and append is not True:
        issues.append(
            (
                "reset_attention_mask",
                "requires append_eod: true (MindSpeed rule: documents are separated at the EOD tokens "
                "that preprocessing appends)",
            )
        )
    if "disable_shuffling" in flat:
        flat_shuffle = flat["disable_shuffling"]
        # MindSpeed's mg path reads with MegatronPretrainingSampler, which never shuffles (the
        # GPTDataset's own shuffle index orders the samples); disable_shuffling only affects lf.
        flat.pop("disable_shuffling")
        to("train_dataset.dataloader.shuffle", False, "data_manager_type")
        if "disable_shuffling" in given:
            say(
                f"disable_shuffling = {flat_shuffle!r} -> no effect with data_manager_type 'mg': Megatron data "
                "is read in the GPTDataset's own shuffled order"
            )


def _parallel(flat: Flat, given: Flat, to: To, choice: Choice, say: Say, issues: list[Issue]) -> None:
    """ParallelArguments (and `param_dtype` -> model.compute_dtype, `recompute` -> recompute)."""
    simple = {
        "tp_size": "tensor_parallel",
        "ep_size": "expert_parallel",
        "cp_size": "context_parallel",
        "ep_fsdp_size": "ep_fsdp_size",
        "reshard_after_forward": "reshard_after_forward",
    }
    for key, target in simple.items():
        if key in flat:
            to(f"parallelism.{target}", flat[key], key)
    if "fsdp_size" in flat:
        # MindSpeed requires fsdp_size == world / tp (dp == 1): that is meshforge's pure FSDP over all ranks.
        to("parallelism.data_parallel_shard", -1, "fsdp_size")
    if "cp_type" in flat:
        method = choice("cp_type", CP_METHODS)
        if method:
            to("parallelism.context_parallel_method", method, "cp_type")
    elif isinstance(cp_size := flat.get("cp_size"), int) and cp_size > 1:
        to("parallelism.context_parallel_method", "ulysses", "cp_type")
    if flat.get("cp_size", 1) != 1 and flat.get("cp_type", "ulysses") == "ulysses":
        to("parallelism.ulysses_degree_in_cp", flat["cp_size"], "cp_size")
    for key in (
        "fsdp_modules",
        "ignored_modules",
        "shard_placement_fn",
        "efsdp_shard_placement_fn",
        "hook_modules",
        "fsdp_implementation",
        "tp_colwise",
        "tp_rowwise",
        "ep_modules",
        "ep_fsdp_modules",
        "ep_dispatcher",
        "reduce_dtype",
        "num_to_forward_prefetch",
        "num_to_backward_prefetch",
        "enable_chunk_batch",
        "chunk_mbs",
        "chunk_mbs_batch_dim",
        "chunk_mbs_modules",
        "chunk_mbs_arg_indexs",
        "chunk_mbs_kwarg_names",
    ):
        if key in flat:
            to(f"parallelism.{key}", flat[key], key)
    if "param_dtype" in flat:
        # MindSpeed's FSDP param_dtype is the compute dtype of the sharded model; master weights stay fp32.
        dtype = choice("param_dtype", {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"})
        if dtype:
            to("model.compute_dtype", dtype, "param_dtype")
    if "recompute_granularity" in flat or "recompute_method" in flat or "recompute_num_layers" in flat:
        megatron_recompute(flat, to, say, issues)
    elif flat.get("recompute") is True:
        to("recompute.mode", "full", "recompute")
        to("recompute.modules", flat.get("recompute_modules", ["model.layers.{*}"]), "recompute_modules")
    else:
        if "recompute" in flat:
            to("recompute.mode", "None", "recompute")
        if "recompute_modules" in given:
            say("recompute_modules -> unused: recompute is false")
