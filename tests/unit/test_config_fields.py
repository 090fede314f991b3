"""Every field of every section is read, refused or warned: nothing in a config is silently ignored.

The walk gives each field a non-default value (derived from its type, or from `VALUES` where the
type alone does not give a valid one), loads the config, and asks which of the three it is:
- refused: `check_trainable` raises `not supported yet` at the field's path (or its section's);
- warned: `validate_config` on the CPU warns at that path (`config/noops.py`);
- read: `config/readers.py` names the module that reads it, and that module's code mentions the
  field (an attribute or a string of its name).
A new field that is none of these fails here with its key path.
"""

from __future__ import annotations

import ast
import importlib.util
import types
import typing
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pytest
from pydantic import BaseModel

from meshforge.config import ConfigError, check_trainable, config_from_dict
from meshforge.config.checks import validate_config
from meshforge.config.readers import READERS, field_readers
from meshforge.config.root import TrainConfig

BASE: dict[str, Any] = {
    "model": {"model_type": "qwen3"},
    "train_dataset": {"dataloader": {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": 8}},
    "context": {"device_target": "cpu"},
}

# Values the type alone does not make valid (a schedule name, a module pattern, a layer spec ...),
# with the other keys the value needs, merged into BASE.
VALUES: dict[str, dict[str, Any]] = {
    "checkpoint.save_max": {"checkpoint": {"save_max": 2}},
    "training.global_batch_size": {"training": {"global_batch_size": 2}},
    "training.local_batch_size": {"training": {"local_batch_size": 2, "global_batch_size": 2}},
    "training.gradient_accumulation_steps": {"training": {"gradient_accumulation_steps": 2}},
    "training.rampup_batch_size": {"training": {"rampup_batch_size": [1, 1, 10]}},
    "training.stage": {
        "training": {"stage": "sft"},
        "train_dataset": {"dataloader": {"type": "SFTDataLoader"}},
    },
    "parallelism.data_parallel_shard": {"parallelism": {"data_parallel_shard": 1}},
    "parallelism.data_parallel_shard_strategy": {"parallelism": {"data_parallel_shard_strategy": "optim"}},
    "parallelism.dense_fsdp_shard_size": {"parallelism": {"dense_fsdp_shard_size": 1}},
    "parallelism.ulysses_degree_in_cp": {
        "parallelism": {"context_parallel": 2, "context_parallel_method": "hybrid", "ulysses_degree_in_cp": 2}
    },
    "parallelism.pipeline_parallel_layers_per_stage": {
        "parallelism": {"pipeline_parallel": 2, "pipeline_parallel_layers_per_stage": [[0], [1]]}
    },
    "parallelism.pipeline_parallel_schedule": {
        "parallelism": {"pipeline_parallel": 2, "pipeline_parallel_schedule": "gpipe"}
    },
    "parallelism.pipeline_parallel_interleave_num": {
        "parallelism": {
            "pipeline_parallel": 2,
            "pipeline_parallel_interleave_num": 2,
            "pipeline_parallel_schedule": "interleaved_1f1b",
        }
    },
    "parallelism.pipeline_parallel_microbatch_size": {
        "parallelism": {"pipeline_parallel": 2, "pipeline_parallel_microbatch_size": 4}
    },
    "parallelism.pipeline_parallel_p2p_transport": {
        "parallelism": {"pipeline_parallel_p2p_transport": "hccs"}
    },
    "parallelism.sequence_parallel": {"parallelism": {"tensor_parallel": 2, "sequence_parallel": False}},
    "parallelism.moe_token_dispatcher_type": {
        "parallelism": {
            "moe_token_dispatcher_type": "alltoall_deredundancy",
            "expert_parallel": 8,
            "npu_nums_per_device": 8,
        }
    },
    "parallelism.npu_nums_per_device": {"parallelism": {"npu_nums_per_device": 4}},
    "parallelism.ep_fsdp_size": {"parallelism": {"ep_fsdp_size": 1}},
    "parallelism.fsdp_modules": {"parallelism": {"fsdp_modules": ["model.layers.{*}"]}},
    "parallelism.ignored_modules": {"parallelism": {"ignored_modules": ["model.norm"]}},
    "parallelism.shard_placement_fn": {"parallelism": {"shard_placement_fn": "shard_largest_dim"}},
    "parallelism.hook_modules": {"parallelism": {"hook_modules": ["model.layers.{*}.mlp"]}},
    "parallelism.tp_colwise": {"parallelism": {"tp_colwise": ["*.q_proj"]}},
    "parallelism.tp_rowwise": {"parallelism": {"tp_rowwise": ["*.o_proj"]}},
    "parallelism.ep_modules": {"parallelism": {"ep_modules": ["model.layers.{*}.mlp"]}},
    "parallelism.ep_fsdp_modules": {"parallelism": {"ep_fsdp_modules": ["model.layers.{*}.mlp"]}},
    "parallelism.param_dtype": {"parallelism": {"param_dtype": "bf16"}},
    "parallelism.chunk_mbs_modules": {"parallelism": {"chunk_mbs_modules": ["model.layers.{*}.mlp"]}},
    "parallelism.chunk_mbs_kwarg_names": {"parallelism": {"chunk_mbs_kwarg_names": ["position_ids"]}},
    "parallelism.chunk_mbs_arg_indexs": {"parallelism": {"chunk_mbs_arg_indexs": [1]}},
    "parallelism.fault_tolerance.replica_id": {"parallelism": {"fault_tolerance": {"replica_id": 1}}},
    "optimizer.type": {"optimizer": {"type": "FusedAdamW"}},
    "optimizer.betas": {"optimizer": {"betas": [0.8, 0.9]}},
    "optimizer.weight_decay_include": {"optimizer": {"weight_decay_include": ["*.weight"]}},
    "optimizer.weight_decay_exclude": {"optimizer": {"weight_decay_exclude": ["*.bias"]}},
    "lr_scheduler.type": {"lr_scheduler": {"type": "constant"}},
    "train_dataset.dataloader.type": {
        "train_dataset": {"dataloader": {"type": "BlendedMegatronDatasetDataLoader"}}
    },
    "train_dataset.dataloader.column_names": {
        "train_dataset": {"dataloader": {"column_names": ["input_ids"]}}
    },
    "train_dataset.dataset": {"train_dataset": {"dataset": "alpaca"}},
    "train_dataset.eval_dataset": {"train_dataset": {"eval_dataset": "alpaca"}},
    "train_dataset.template": {"train_dataset": {"template": "qwen3"}},
    "train_dataset.interleave_probs": {
        "train_dataset": {"dataset": "a,b", "mix_strategy": "interleave_under", "interleave_probs": "0.5,0.5"}
    },
    "train_dataset.mix_strategy": {"train_dataset": {"mix_strategy": "interleave_over"}},
    "train_dataset.val_size": {"train_dataset": {"dataset": "a", "val_size": 0.1}},
    "train_dataset.streaming": {"train_dataset": {"streaming": True}},
    "train_dataset.reset_attention_mask": {
        "train_dataset": {"reset_attention_mask": True, "append_eod": True}
    },
    "train_dataset.tool_format": {"train_dataset": {"tool_format": "qwen"}},
    "train_dataset.mask_history": {"train_dataset": {"mask_history": True}},
    "model.model_type": {"model": {"model_type": "llama"}},
    "model.architectures": {"model": {"model_type": None, "architectures": ["LlamaForCausalLM"]}},
    "model.model_id": {"model": {"model_type": None, "model_id": "qwen3_moe"}},
    "model.compute_dtype": {"model": {"compute_dtype": "bfloat16"}},
    "model.params_dtype": {"model": {"params_dtype": "bfloat16"}},
    "model.use_flash_attention": {"model": {"use_flash_attention": True}},
    "model.add_tokens": {"model": {"add_tokens": "<a>"}},
    "model.add_special_tokens": {"model": {"add_special_tokens": "<b>"}},
    "model.new_special_tokens_config": {"model": {"new_special_tokens_config": "tokens.yaml"}},
    "model.quant_recipe_name": {"model": {"quant_recipe_name": "mxfp8"}},
    "model.quant_apply_modules": {"model": {"quant_apply_modules": ["model.layers.0"]}},
    "model.quant_ignored_modules": {"model": {"quant_ignored_modules": ["*lm_head"]}},
    "model.quant_converters": {"model": {"quant_converters": ["quantize.linear.float8"]}},
    "monitor.train_state.local_norm": {"monitor": {"train_state": {"local_norm": True}}},
    "monitor.moe_monitor.target_layers": {"monitor": {"moe_monitor": {"target_layers": 1}}},
    "context.device_target": {"context": {"device_target": "cuda"}},
    "context.max_device_memory": {"context": {"max_device_memory": "30GB"}},
    "profiler.start_step": {"profiler": {"start_step": 2, "end_step": 3}},
    "profiler.profiler_rank": {"profiler": {"profiler_rank": [0]}},
    "recompute.mode": {"recompute": {"mode": "full", "full_recompute_layer": ["0"]}},
    "recompute_comm.enable": {"recompute_comm": {"enable": True, "select_module": {"attn": ["0"]}}},
    "recompute.full_recompute_layer": {"recompute": {"mode": "full", "full_recompute_layer": ["0-1"]}},
    "recompute.select_module": {"recompute": {"mode": "select", "select_module": {"mlp": ["0"]}}},
    "recompute.exclude_op": {
        "recompute": {"mode": "full", "full_recompute_layer": ["0"], "exclude_op": ["matmul"]}
    },
    "recompute.modules": {"recompute": {"mode": "full", "modules": ["model.layers.{*}"]}},
    "recompute_comm.select_module": {"recompute_comm": {"enable": True, "select_module": {"attn": ["0"]}}},
    "swap.layer_swap": {"swap": {"layer_swap": [{"layers": ["0"]}]}},
    "swap.op_swap": {"swap": {"op_swap": [{"op_name": "matmul", "layers": ["0"]}]}},
    "callbacks": {"callbacks": [{"type": "Printer"}]},
    "lora_config.target_modules": {"lora_config": {"target_modules": ".*q_proj"}},
    "lora_config.exclude_layers": {"lora_config": {"exclude_layers": ["0"]}},
    "kernels.use_flash_attn": {"kernels": {"use_flash_attn": "auto"}},
    "kernels.use_fused_rmsnorm": {"kernels": {"use_fused_rmsnorm": "auto"}},
    "kernels.use_fused_rotary_pos_emb": {"kernels": {"use_fused_rotary_pos_emb": "auto"}},
    "kernels.use_ascend_mhc": {"model": {"model_id": "deepseek_v4"}, "kernels": {"use_ascend_mhc": True}},
    "kernels.use_triton_swiglu_limit": {
        "model": {"model_id": "deepseek_v4"},
        "kernels": {"use_triton_swiglu_limit": True},
    },
}


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _section_of(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(path, annotation, default) of every leaf field; `callbacks` counts as one leaf."""
    out = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        section = _section_of(info.annotation)
        if section is not None and get_origin(info.annotation) is not list:
            out += _leaf_fields(section, f"{path}.")
        else:
            out.append((path, info.annotation, info.default))
    return out


FIELDS = _leaf_fields(TrainConfig)


def _unwrap(annotation: Any) -> Any:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _sample(annotation: Any, default: Any) -> Any:
    """A value of `annotation` other than `default`, or None when the type gives none."""
    annotation = _unwrap(annotation)
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        for arg in get_args(annotation):
            if arg is type(None):
                continue
            value = _sample(arg, default)
            if value is not None:
                return value
        return None
    if origin is Literal:
        others = [v for v in get_args(annotation) if v != default]
        return others[0] if others else None
    if annotation is bool:
        return not default
    if annotation is int:
        return (default + 1) if isinstance(default, int) else 2
    if annotation is float:
        return (default + 0.25) if isinstance(default, int | float) else 0.5
    if annotation is str:
        return "x" if default != "x" else "y"
    if origin is list:
        item = _sample(get_args(annotation)[0], None)
        return [item] if item is not None else None
    return None


def _single_value(annotation: Any) -> bool:
    annotation = _unwrap(annotation)
    return get_origin(annotation) is Literal and len(get_args(annotation)) == 1


def _override(path: str, value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def _config_for(path: str, annotation: Any, default: Any) -> TrainConfig | None:
    if path in VALUES:
        extra = VALUES[path]
        if extra is None:
            return None
    elif _single_value(annotation):
        return None  # one allowed value: nothing to walk
    else:
        value = _sample(annotation, default)
        if value is None:
            pytest.fail(f"{path}: the type gives no non-default value; add one to VALUES")
        extra = _override(path, value)
    try:
        return config_from_dict(_merge(BASE, extra))
    except ConfigError as err:
        pytest.fail(f"{path}: the walk's value is invalid ({err}); give a valid one in VALUES")


def _refused(cfg: TrainConfig, path: str) -> bool:
    try:
        check_trainable(cfg)
    except ConfigError as err:
        return any(
            "not supported yet" in reason and (path == where or path.startswith(where.split("[")[0] + "."))
            for where, reason in err.issues
        )
    return False


def _warned(cfg: TrainConfig, path: str) -> bool:
    return any(where == path for where, _ in validate_config(cfg).warnings)


@cache
def _names_in(module: str) -> frozenset[str]:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"config/readers.py names {module}, which does not exist"
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return frozenset(names)


def _read(path: str) -> bool:
    module = field_readers().get(path)
    return module is not None and path.split(".")[-1] in _names_in(module)


@pytest.mark.parametrize(("path", "annotation", "default"), FIELDS, ids=[f[0] for f in FIELDS])
def test_every_field_is_read_refused_or_warned(path: str, annotation: Any, default: Any) -> None:
    if _read(path):
        return
    cfg = _config_for(path, annotation, default)
    if cfg is None:
        return
    assert _refused(cfg, path) or _warned(cfg, path), (
        f"{path}: a non-default value is neither read (config/readers.py), refused "
        "(config/unsupported.py) nor warned (config/noops.py)"
    )


def test_readers_name_real_fields_and_modules_that_read_them() -> None:
    known = {path for path, _, _ in FIELDS}
    for module, paths in READERS.items():
        for path in paths:
            assert path in known, f"config/readers.py: {path} is not a config field"
            assert path.split(".")[-1] in _names_in(module), f"{module} does not read {path}"


def test_the_walk_can_fail() -> None:
    # A field that nothing reads, refuses or warns about is caught by the same three checks.
    cfg = config_from_dict(_merge(BASE, {"training": {"seed": 7}}))
    assert not _refused(cfg, "training.seed") and not _warned(cfg, "training.seed")
    assert not _read("training.no_such_field")


def test_the_samples_differ_from_defaults() -> None:
    assert _sample(typing.Optional[int], None) == 2  # noqa: UP045 (the walk meets this spelling)
    assert _sample(Literal["a", "b"], "a") == "b"
    assert _sample(bool, True) is False
