"""Every argument MindSpeed-LLM's FSDP2 backend defines, with its type, default and choices.

Read from the argument dataclasses of `mindspeed_llm/fsdp2/utils/arguments.py` (ModelArguments,
DataArguments, ParallelArguments, TrainingArguments, InferenceArguments, OptimizationArguments) at
MindSpeed-LLM commit c77308a14bfc (2026-08-21; the file last changed 2026-08-05). The group is the
field name of the root dataclass in `train_fsdp2.py` / `inference_fsdp2.py` (`model:`, `data:`,
...), which is also the prefix of its command-line form (`--parallel.fsdp_size`).

The importer uses it three ways: a name here that meshforge does not map answers `not supported
yet: <name>` (a real argument, not built), while only a name outside this list is an unknown-key
error with a suggestion; a `choice` value MindSpeed accepts that meshforge does not build answers
`not supported yet: <name>=<value>`; and `bool` arguments take what MindSpeed's parser takes
(`_string_to_bool`: 1/0, yes/no, true/false, t/f, y/n).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from meshforge.models.config import MS_MODEL_IDS

SOURCE = "MindSpeed-LLM c77308a14bfc (2026-08-21), mindspeed_llm/fsdp2/utils/arguments.py"

Kind = Literal["bool", "int", "float", "str", "list", "dict_or_str", "choice"]


class MsArg(NamedTuple):
    """One MindSpeed argument: group, name, value kind, default (`REQUIRED` = none), choices."""

    group: str
    name: str
    kind: Kind
    default: object
    choices: tuple[object, ...] = ()


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()
_REQUIRED = REQUIRED


def _arg(group: str, name: str, kind: Kind, default: object, choices: tuple[object, ...] = ()) -> MsArg:
    return MsArg(group, name, kind, default, choices)


ARGUMENTS: tuple[MsArg, ...] = (
    # ModelArguments
    _arg("model", "model_name_or_path", "str", _REQUIRED),
    _arg(
        "model",
        "model_id",
        "choice",
        None,
        MS_MODEL_IDS,
    ),
    _arg("model", "init_model_with_meta_device", "bool", False),
    _arg("model", "trust_remote_code", "bool", False),
    _arg("model", "train_from_scratch", "bool", False),
    _arg("model", "tokenizer_name_or_path", "str", None),
    _arg("model", "cache_dir", "str", None),
    _arg("model", "use_fast_tokenizer", "bool", True),
    _arg("model", "resize_vocab", "bool", False),
    _arg("model", "split_special_tokens", "bool", False),
    _arg("model", "add_tokens", "str", None),
    _arg("model", "add_special_tokens", "str", None),
    _arg("model", "new_special_tokens_config", "str", None),
    _arg(
        "model",
        "init_special_tokens",
        "choice",
        "noise_init",
        ("noise_init", "desc_init", "desc_init_w_noise"),
    ),
    _arg("model", "model_revision", "str", "main"),
    _arg("model", "hf_hub_token", "str", None),
    _arg("model", "ms_hub_token", "str", None),
    _arg("model", "om_hub_token", "str", None),
    _arg("model", "quant_recipe_name", "choice", None, ("mxfp8",)),
    _arg("model", "quant_apply_modules", "list", ["model.layers.{*}"]),
    _arg("model", "quant_ignored_modules", "list", ["*lm_head", "*gate"]),
    _arg("model", "quant_converters", "list", ["quantize.linear.mx"]),
    _arg("model", "enable_fsdp_low_precision_all_gather", "bool", True),
    _arg("model", "fsdp_low_precision_all_gather_mode", "choice", "on-demand", ("on-demand", "all")),
    # DataArguments
    _arg("data", "template", "str", None),
    _arg("data", "dataset", "dict_or_str", None),
    _arg("data", "eval_dataset", "dict_or_str", None),
    _arg("data", "dataset_dir", "str", "./configs/fsdp2/data"),
    _arg("data", "cutoff_len", "int", 2048),
    _arg("data", "train_on_prompt", "bool", False),
    _arg("data", "mask_history", "bool", False),
    _arg("data", "streaming", "bool", False),
    _arg("data", "buffer_size", "int", 16384),
    _arg("data", "mix_strategy", "choice", "concat", ("concat", "interleave_under", "interleave_over")),
    _arg("data", "interleave_probs", "str", None),
    _arg("data", "overwrite_cache", "bool", False),
    _arg("data", "preprocessing_batch_size", "int", 1000),
    _arg("data", "preprocessing_num_workers", "int", None),
    _arg("data", "max_samples", "int", None),
    _arg("data", "eval_num_beams", "int", None),
    _arg("data", "ignore_pad_token_for_loss", "bool", True),
    _arg("data", "val_size", "float", 0.0),
    _arg("data", "eval_on_each_dataset", "bool", False),
    _arg("data", "packing", "bool", False),
    _arg("data", "neat_packing", "bool", False),
    _arg("data", "tool_format", "str", None),
    _arg("data", "default_system", "str", None),
    _arg("data", "enable_thinking", "bool", True),
    _arg("data", "tokenized_path", "str", None),
    _arg("data", "data_shared_file_system", "bool", False),
    _arg("data", "data_manager_type", "choice", "lf", ("lf", "mg")),
    _arg("data", "split", "str", "100,0,0"),
    _arg("data", "create_attention_mask_in_dataloader", "bool", False),
    _arg("data", "no_shared_storage", "bool", False),
    _arg("data", "dataloader_type", "choice", "single", ("single",)),
    _arg("data", "reset_attention_mask", "bool", False),
    _arg("data", "append_eod", "bool", False),
    # ParallelArguments
    _arg("parallel", "tp_size", "int", 1),
    _arg("parallel", "fsdp_size", "int", 1),
    _arg("parallel", "recompute", "bool", False),
    _arg("parallel", "ep_size", "int", 1),
    _arg("parallel", "ep_fsdp_size", "int", 1),
    _arg("parallel", "cp_size", "int", 1),
    _arg("parallel", "cp_type", "choice", "ulysses", ("ulysses", "ring", "kvallgather")),
    _arg("parallel", "fsdp_modules", "list", ["model.layers.{*}", "model.embed_tokens", "lm_head"]),
    _arg("parallel", "ignored_modules", "list", None),
    _arg("parallel", "reshard_after_forward", "bool", True),
    _arg("parallel", "shard_placement_fn", "str", None),
    _arg("parallel", "efsdp_shard_placement_fn", "str", "shard_by_dim_1"),
    _arg("parallel", "hook_modules", "list", ["model.layers.{*}"]),
    _arg("parallel", "fsdp_implementation", "choice", "native", ("custom", "native")),
    _arg("parallel", "tp_colwise", "list", ["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj"]),
    _arg("parallel", "tp_rowwise", "list", ["*.o_proj", "*.down_proj"]),
    _arg("parallel", "ep_modules", "list", ["model.layers.{*}.mlp.experts"]),
    _arg("parallel", "ep_fsdp_modules", "list", ["model.layers.{*}.mlp.experts"]),
    _arg("parallel", "ep_dispatcher", "choice", "eager", ("eager", "fused", "mc2")),
    _arg("parallel", "recompute_modules", "list", ["model.layers.{*}"]),
    _arg("parallel", "param_dtype", "choice", "bf16", ("bf16", "fp16", "fp32")),
    _arg("parallel", "reduce_dtype", "choice", "fp32", ("bf16", "fp16", "fp32")),
    _arg("parallel", "num_to_forward_prefetch", "int", 1),
    _arg("parallel", "num_to_backward_prefetch", "int", 1),
    _arg("parallel", "enable_chunk_batch", "bool", False),
    _arg("parallel", "chunk_mbs", "int", 1),
    _arg("parallel", "chunk_mbs_batch_dim", "int", 0),
    _arg("parallel", "chunk_mbs_modules", "list", ["model.layers.{*}"]),
    _arg("parallel", "chunk_mbs_arg_indexs", "list", [0]),
    _arg(
        "parallel",
        "chunk_mbs_kwarg_names",
        "list",
        ["position_embeddings", "position_ids", "attention_mask", "input_ids"],
    ),
    # TrainingArguments
    _arg("training", "output_dir", "str", _REQUIRED),
    _arg("training", "deterministic", "bool", True),
    _arg("training", "optimizer", "choice", "adamw", ("adamw", "muon", "fused_adamw")),
    _arg("training", "lr", "float", 1e-05),
    _arg("training", "weight_decay", "float", 0.01),
    _arg("training", "adam_beta1", "float", 0.9),
    _arg("training", "adam_beta2", "float", 0.95),
    _arg("training", "adam_epsilon", "float", 1e-08),
    _arg("training", "max_grad_norm", "float", 1.0),
    _arg("training", "lr_scheduler_type", "choice", "cosine", ("cosine", "linear", "constant")),
    _arg("training", "warmup_ratio", "float", 0.03),
    _arg("training", "min_lr", "float", 1e-06),
    _arg("training", "num_train_epochs", "float", 3.0),
    _arg("training", "max_steps", "int", -1),
    _arg("training", "gradient_accumulation_steps", "int", 1),
    _arg("training", "disable_shuffling", "bool", False),
    _arg("training", "seed", "int", 42),
    _arg("training", "indexer_loss_coeff", "float", 1.0),
    _arg("training", "router_aux_loss_coef", "float", 0.0),
    _arg("training", "save_steps", "int", 500),
    _arg("training", "save_total_limit", "int", 3),
    _arg("training", "resume_from_checkpoint", "str", None),
    _arg("training", "logging_steps", "int", 1),
    _arg("training", "log_throughput", "bool", False),
    _arg("training", "log_cpu_memory", "bool", False),
    _arg("training", "mtp_loss_scaling_factor", "float", 0.3),
    _arg("training", "stage", "choice", "sft", ("pt", "sft")),
    _arg("training", "calculate_per_token_loss", "bool", False),
    _arg("training", "dataloader_num_workers", "int", 0),
    _arg("training", "dataloader_prefetch_factor", "int", None),
    _arg("training", "dataloader_pin_memory", "bool", True),
    _arg("training", "dataloader_persistent_workers", "bool", False),
    _arg("training", "dataloader_drop_last", "bool", False),
    _arg("training", "per_device_train_batch_size", "int", 8),
    _arg("training", "save_only_model", "bool", False),
    _arg("training", "save_async", "bool", False),
    _arg("training", "save_epochs", "int", 1),
    _arg("training", "save_hf_weights", "bool", True),
    _arg("training", "profile", "bool", False),
    _arg("training", "profile_step_start", "int", 0),
    _arg("training", "profile_step_end", "int", -1),
    _arg("training", "profile_ranks", "list", [-1]),
    _arg("training", "profile_level", "str", "level0"),
    _arg("training", "profile_export_type", "str", "text"),
    _arg("training", "profile_data_simplification", "bool", False),
    _arg("training", "profile_with_cpu", "bool", False),
    _arg("training", "profile_with_stack", "bool", False),
    _arg("training", "profile_with_memory", "bool", False),
    _arg("training", "profile_record_shapes", "bool", False),
    _arg("training", "profile_save_path", "str", "./profile"),
    # InferenceArguments
    _arg("inference", "infer_backend", "choice", "huggingface", ("huggingface",)),
    _arg("inference", "max_new_tokens", "int", 512),
    _arg("inference", "do_sample", "bool", False),
    # OptimizationArguments
    _arg("optimization", "use_fused_rmsnorm", "bool", False),
    _arg("optimization", "moe_grouped_gemm", "bool", False),
    _arg("optimization", "use_fused_rotary_pos_emb", "bool", False),
    _arg("optimization", "use_flash_attn", "bool", False),
    _arg("optimization", "use_sparse_flash_attn", "bool", False),
    _arg("optimization", "use_fused_lightning_indexer", "bool", False),
    _arg("optimization", "use_fused_lightning_indexer_loss", "bool", False),
    _arg("optimization", "use_ascend_mhc", "bool", False),
    _arg("optimization", "use_triton_swiglu_limit", "bool", False),
    _arg("optimization", "pre_tokens", "int", 1048576),
    _arg("optimization", "next_tokens", "int", 0),
    _arg("optimization", "use_triton_gdn", "bool", False),
    _arg("optimization", "use_flash_gdn", "bool", False),
    _arg("optimization", "gdn_chunk_size", "int", 64),
    _arg("optimization", "chunk_loss_size", "int", None),
    _arg("optimization", "use_triton_rmsnormgated", "bool", False),
    _arg("optimization", "fix_router", "bool", False),
)

BY_NAME: dict[str, MsArg] = {arg.name: arg for arg in ARGUMENTS}

# MindSpeed's `_string_to_bool`: the spellings its parser turns into a bool (case-insensitive).
TRUE_WORDS = frozenset({"yes", "true", "t", "y", "1"})
FALSE_WORDS = frozenset({"no", "false", "f", "n", "0"})


def as_bool(value: object) -> bool | None:
    """`value` read as MindSpeed reads a boolean argument, or None when it would refuse it.

    YAML values reach MindSpeed's parser as `str(value)`, so the integers 1 and 0 and the words
    above are booleans there.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int | str):
        word = str(value).strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    return None
