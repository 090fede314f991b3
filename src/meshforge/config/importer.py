"""Import MindSpeed-LLM FSDP2 arguments (flat or grouped YAML) into the native sectioned format.

MindSpeed YAML groups keys under `model:/data:/parallel:/training:/optimization:` (`inference:`
for generation) or writes them flat. Each key is mapped to its native path, and a line per key
reports what it became. Unknown keys are errors with a suggestion (MindSpeed itself only logs
them). MindSpeed defaults that differ from meshforge's are written into the result when they
change what a run does, so a migrated file means what it meant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshforge.config.base import ConfigError, Issue, suggest
from meshforge.config.recompute_import import megatron_recompute
from meshforge.data.config import SFT_FIELDS

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

SCHEDULERS = {"cosine": "CosineWithWarmUpLR", "linear": "LinearWithWarmUpLR", "constant": "ConstantWarmUpLR"}
OPTIMIZERS = {"adamw": "AdamW", "muon": "Muon", "fused_adamw": "FusedAdamW"}
LOADERS = {"mg": "BlendedMegatronDatasetDataLoader", "lf": "SFTDataLoader"}
# The stage each data manager serves; MindSpeed's data factory refuses any other pair.
DATA_MANAGER_STAGE = {"lf": "sft", "mg": "pt"}
# MindSpeed data keys that the Megatron loader reads under its own config with data_manager_type mg.
MEGATRON_DATA_KEYS = frozenset(
    {"dataset", "cutoff_len", "create_attention_mask_in_dataloader", "reset_attention_mask", "append_eod"}
)
CP_METHODS = {"ulysses": "ulysses", "ring": "colossal", "kvallgather": "kvallgather"}
PROFILE_LEVELS = {"level_none": 0, "level0": 0, "level1": 1, "level2": 2}

# MindSpeed defaults that change what a run does relative to meshforge's: applied when absent.
MS_DEFAULTS: dict[str, Any] = {
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


Flat = dict[str, Any]
To = Callable[[str, Any, str], None]  # (native path, value, MindSpeed key)
Choice = Callable[[str, dict[str, Any]], Any]  # (MindSpeed key, table) -> mapped value or None
Say = Callable[[str], None]


def flatten(raw: dict[str, Any]) -> tuple[dict[str, Any], list[Issue]]:
    """Flatten grouped MindSpeed YAML into {key: value}; unknown keys become issues."""
    flat: dict[str, Any] = {}
    issues: list[Issue] = []
    where: dict[str, str] = {}

    def put(key: str, value: Any, path: str) -> None:
        if key not in ALL_KEYS:
            guess = suggest(key, list(ALL_KEYS) + list(GROUPS))
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
                expected = ALL_KEYS.get(sub)
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


def _set(native: dict[str, Any], path: str, value: Any) -> None:
    node = native
    parts = path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _comma_list(value: Any) -> Any:
    if isinstance(value, str) and "," in value:
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def import_mindspeed(raw: dict[str, Any], log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Map a MindSpeed-format config to a native config dict.

    Args:
        raw: the parsed YAML (flat keys, groups, or both).
        log: receives one line per key: `<MindSpeed key> -> <native path> = <value>`.

    Raises:
        ConfigError: unknown keys (with a suggestion), keys in the wrong group, bad enum values.
    """
    flat, issues = flatten(raw)
    say = log or (lambda _line: None)
    native: dict[str, Any] = {}
    given = dict(flat)
    for key, value in MS_DEFAULTS.items():
        if key not in flat:
            flat[key] = value

    def to(path: str, value: Any, key: str) -> None:
        _set(native, path, value)
        origin = "" if key in given else " (MindSpeed default)"
        say(f"{key} -> {path} = {value!r}{origin}")

    def choice(key: str, table: dict[str, Any]) -> Any:
        value = flat[key]
        if value not in table:
            issues.append((key, f"must be one of {sorted(table)}, got {value!r}"))
            return None
        return table[value]

    for key in MODEL_KEYS:
        if key in flat:
            to(f"model.{key}", flat[key], key)

    loader = choice("data_manager_type", LOADERS)
    if loader:
        to("train_dataset.dataloader.type", loader, "data_manager_type")
    megatron = flat["data_manager_type"] == "mg"
    pair = DATA_MANAGER_STAGE.get(flat["data_manager_type"])
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
        if key == "split":
            if megatron:
                to("train_dataset.dataloader.config.split", value, key)
            elif key in given:
                issues.append((key, "only used by data_manager_type 'mg' (Megatron data)"))
        else:
            to(f"train_dataset.{key}", value, key)

    _parallel(flat, given, to, choice, say, issues)
    _training(flat, given, to, choice, say, issues)

    for key in OPTIMIZATION_KEYS:
        if key in flat:
            to(f"kernels.{key}", flat[key], key)
    for key in INFERENCE_KEYS:
        if key in flat:
            to(f"inference.{key}", flat[key], key)
    if issues:
        raise ConfigError(issues)
    return native


def _megatron_flags(flat: Flat, given: Flat, to: To, say: Say, issues: list[Issue]) -> None:
    """`data_manager_type: mg`: the data keys the Megatron GPTDataset reads go to its own config.

    The native Megatron loader reads `train_dataset.dataloader.config.*` (data/megatron/specs.py);
    the `train_dataset.*` fields of the same names belong to the SFT loader and would be refused
    there. `append_eod` is a preprocessing switch in MindSpeed (its mg manager tokenizes raw data
    itself); meshforge reads data already preprocessed, so it is checked and reported, not placed.
    """
    data = "train_dataset.dataloader.config"
    if "dataset" in flat:
        to(f"{data}.data_path", _comma_list(flat["dataset"]), "dataset")
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
    if "append_eod" in given:
        say(
            f"append_eod -> not a loader option (= {append!r}): the .bin/.idx data must already end each "
            "document with EOD; preprocess raw text with `meshforge preprocess --append-eod`"
        )
    if "disable_shuffling" in flat:
        # MindSpeed's mg path reads with MegatronPretrainingSampler, which never shuffles (the
        # GPTDataset's own shuffle index orders the samples); disable_shuffling only affects lf.
        flat.pop("disable_shuffling")
        to("train_dataset.dataloader.shuffle", False, "data_manager_type")
        if "disable_shuffling" in given and given["disable_shuffling"] is not True:
            say("disable_shuffling -> unused with data_manager_type 'mg': Megatron data is read in order")


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
    elif isinstance(flat.get("cp_size"), int) and flat["cp_size"] > 1:
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
    elif "recompute" in flat:
        to("recompute.mode", "None", "recompute")
        if "recompute_modules" in given:
            say("recompute_modules -> unused: recompute is false")


def _training(flat: Flat, given: Flat, to: To, choice: Choice, say: Say, issues: list[Issue]) -> None:
    """TrainingArguments, including the profiling keys."""
    simple = {
        "output_dir": "training.output_dir",
        "deterministic": "training.deterministic",
        "seed": "training.seed",
        "weight_decay": "optimizer.weight_decay",
        "adam_epsilon": "optimizer.eps",
        "max_grad_norm": "training.max_norm",
        "lr": "lr_scheduler.learning_rate",
        "warmup_ratio": "lr_scheduler.warmup_ratio",
        "gradient_accumulation_steps": "training.gradient_accumulation_steps",
        "indexer_loss_coeff": "training.indexer_loss_coeff",
        "router_aux_loss_coef": "training.router_aux_loss_coef",
        "save_steps": "checkpoint.save_interleaved_steps",
        "save_total_limit": "checkpoint.save_max",
        "logging_steps": "training.log_interval",
        "log_throughput": "training.log_throughput",
        "log_cpu_memory": "training.log_cpu_memory",
        "mtp_loss_scaling_factor": "training.mtp_loss_scaling_factor",
        "stage": "training.stage",
        "calculate_per_token_loss": "training.calculate_per_token_loss",
        "dataloader_num_workers": "train_dataset.num_parallel_workers",
        "dataloader_pin_memory": "train_dataset.pin_memory",
        "dataloader_persistent_workers": "train_dataset.persistent_workers",
        "dataloader_drop_last": "train_dataset.drop_remainder",
        "per_device_train_batch_size": "training.local_batch_size",
        "save_only_model": "checkpoint.no_save_optim",
        "save_async": "checkpoint.async_save",
        "save_epochs": "checkpoint.save_epochs",
        "save_hf_weights": "checkpoint.save_hf_weights",
        "profile": "profiler.enable_profiling",
        "profile_export_type": "profiler.export_type",
        "profile_data_simplification": "profiler.data_simplification",
        "profile_with_cpu": "profiler.profile_cpu",
        "profile_with_stack": "profiler.with_stack",
        "profile_with_memory": "profiler.profile_memory",
        "profile_record_shapes": "profiler.record_shapes",
        "profile_save_path": "profiler.output_path",
    }
    for key, target in simple.items():
        if key in flat:
            to(target, flat[key], key)
    if "save_hf_weights" not in given:
        say(
            "save_hf_weights: MindSpeed exports HF weights at the end by default; not applied (set checkpoint.save_hf_weights)"
        )
    if "optimizer" in flat:
        name = choice("optimizer", OPTIMIZERS)
        if name:
            to("optimizer.type", name, "optimizer")
    if "adam_beta1" in flat or "adam_beta2" in flat:
        betas = [flat.get("adam_beta1", 0.9), flat.get("adam_beta2", 0.95)]
        to("optimizer.betas", betas, "adam_beta1/adam_beta2")
    scheduler = choice("lr_scheduler_type", SCHEDULERS)
    if scheduler:
        to("lr_scheduler.type", scheduler, "lr_scheduler_type")
        if scheduler == "CosineWithWarmUpLR":
            to("lr_scheduler.min_lr", flat["min_lr"], "min_lr")
        elif "min_lr" in given:
            say(
                f"min_lr -> unused: only the cosine schedule uses it (lr_scheduler_type {flat['lr_scheduler_type']!r})"
            )
    max_steps = flat["max_steps"]
    if isinstance(max_steps, int) and not isinstance(max_steps, bool) and max_steps > 0:
        to("training.steps", max_steps, "max_steps")
        if "num_train_epochs" in given:
            say("num_train_epochs -> unused: max_steps > 0 overrides it")
    else:
        to("training.epochs", flat["num_train_epochs"], "num_train_epochs")
    if "disable_shuffling" in flat:
        value = flat["disable_shuffling"]
        to(
            "train_dataset.dataloader.shuffle",
            (not value) if isinstance(value, bool) else value,
            "disable_shuffling",
        )
    if "resume_from_checkpoint" in flat and flat["resume_from_checkpoint"] is not None:
        to("checkpoint.load_path", flat["resume_from_checkpoint"], "resume_from_checkpoint")
    if "dataloader_prefetch_factor" in flat and flat["dataloader_prefetch_factor"] is not None:
        to("train_dataset.prefetch_size", flat["dataloader_prefetch_factor"], "dataloader_prefetch_factor")
    if "profile_level" in flat:
        level = choice("profile_level", PROFILE_LEVELS)
        if level is not None:
            to("profiler.profiler_level", level, "profile_level")
    if "profile_ranks" in flat:
        ranks = flat["profile_ranks"]
        ranks = ranks if isinstance(ranks, list) else [ranks]
        to("profiler.profiler_rank", None if -1 in ranks else ranks, "profile_ranks")
    _profile_window(flat, to, issues)


def _profile_window(flat: Flat, to: To, issues: list[Issue]) -> None:
    """MindSpeed: start (inclusive, >= 0) .. end (exclusive, -1 = to the end); native: 1-based inclusive."""
    if "profile_step_start" not in flat and "profile_step_end" not in flat:
        return
    start = flat.get("profile_step_start", 0)
    end = flat.get("profile_step_end", -1)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end)):
        issues.append(
            (
                "profile_step_start",
                f"profile_step_start/profile_step_end must be integers, got {start!r}, {end!r}",
            )
        )
        return
    if start < 0 or (end != -1 and end <= start):
        issues.append(
            (
                "profile_step_end",
                f"needs profile_step_start >= 0 and profile_step_end == -1 or > start, got {start}, {end}",
            )
        )
        return
    native_start = max(start, 1)
    if end == -1:
        steps = flat.get("max_steps", -1)
        native_end = steps if isinstance(steps, int) and steps >= native_start else native_start
    else:
        native_end = max(end - 1, native_start)
    to("profiler.start_step", native_start, "profile_step_start")
    to("profiler.end_step", native_end, "profile_step_end")
