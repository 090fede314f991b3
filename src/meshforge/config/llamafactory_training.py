"""The HF Trainer's part of a LLaMA-Factory file (`llamafactory_import.py`): schedule, optimizer,
run length, saving, evaluation, trackers, profiler, recompute, DeepSpeed/FSDP and the Megatron
keys of LLaMA-Factory's MCA path."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshforge.config.base import Issue
from meshforge.config.recompute_import import megatron_recompute

To = Callable[[str, object, str], None]  # (native path, value, LLaMA-Factory key)
Say = Callable[[str], None]


@dataclass
class Importer:
    """One import's state: the keys with LLaMA-Factory's defaults filled (`flat`), the keys written
    (`given`), the writer of native values (`to`), the log and the issues found."""

    flat: dict[str, object]
    given: dict[str, object]
    to: To
    say: Say
    issues: list[Issue]

    def refuse(self, key: str, feature: str) -> None:
        self.issues.append((key, f"not supported yet: {key}: {self.flat.get(key)!r} ({feature})"))


# HF `lr_scheduler_type` -> meshforge schedule.
SCHEDULERS = {
    "linear": "LinearWithWarmUpLR",
    "cosine": "CosineWithWarmUpLR",
    "cosine_with_min_lr": "CosineWithWarmUpLR",
    "cosine_with_restarts": "CosineWithRestartsAndWarmUpLR",
    "polynomial": "PolynomialWithWarmUpLR",
    "constant": "ConstantWarmUpLR",
    "constant_with_warmup": "ConstantWarmUpLR",
    "warmup_stable_decay": "WarmUpStableDecayLR",
}
ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused")
TRACKERS = ("tensorboard", "wandb", "swanlab")


def training_arguments(imp: Importer) -> None:
    """Every HF TrainingArguments / mcore_adapter key the import maps."""
    _batch_and_length(imp)
    _schedule(imp)
    _optimizer(imp)
    _saving(imp)
    _evaluation(imp)
    _logging(imp)
    _profiler(imp)
    _recompute(imp)
    _sharding(imp)
    _megatron(imp)


def _simple(imp: Importer, table: dict[str, str]) -> None:
    for key, path in table.items():
        if key in imp.given and imp.given[key] is not None:
            imp.to(path, imp.given[key], key)


def _batch_and_length(imp: Importer) -> None:
    flat, to = imp.flat, imp.to
    to("training.local_batch_size", flat["per_device_train_batch_size"], "per_device_train_batch_size")
    to(
        "training.gradient_accumulation_steps",
        flat["gradient_accumulation_steps"],
        "gradient_accumulation_steps",
    )
    steps = flat["max_steps"]
    if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0:
        to("training.steps", steps, "max_steps")
        if "num_train_epochs" in imp.given:
            imp.say("num_train_epochs -> unused: max_steps > 0 overrides it")
    else:
        to("training.epochs", flat["num_train_epochs"], "num_train_epochs")
    _simple(
        imp,
        {
            "seed": "training.seed",
            "full_determinism": "training.deterministic",
            "max_grad_norm": "training.max_norm",
            "overwrite_output_dir": "training.overwrite_output_dir",
            "dataloader_num_workers": "train_dataset.num_parallel_workers",
            "dataloader_pin_memory": "train_dataset.pin_memory",
            "dataloader_persistent_workers": "train_dataset.persistent_workers",
            "dataloader_prefetch_factor": "train_dataset.prefetch_size",
            "torch_compile": "kernels.compile",
            "torch_compile_backend": "kernels.compile_backend",
        },
    )
    norm = imp.given.get("max_grad_norm")
    if isinstance(norm, int | float) and not isinstance(norm, bool) and norm <= 0:
        imp.refuse("max_grad_norm", "training without gradient clipping")
    for key in ("dataloader_num_workers", "dataloader_drop_last"):
        if key not in imp.given:
            path = (
                "train_dataset.num_parallel_workers"
                if key.endswith("workers")
                else "train_dataset.drop_remainder"
            )
            to(path, flat[key], key)
    if "dataloader_drop_last" in imp.given:
        to("train_dataset.drop_remainder", imp.given["dataloader_drop_last"], "dataloader_drop_last")
    for key in ("use_cpu", "no_cuda"):
        if imp.given.get(key) is True:
            to("context.device_target", "cpu", key)
    micro = imp.given.get("micro_batch_size")
    if micro is not None and micro != flat["per_device_train_batch_size"]:
        imp.issues.append(
            ("micro_batch_size", f"{micro!r} differs from per_device_train_batch_size; give one")
        )
    elif micro is not None:
        imp.say(
            f"micro_batch_size: {micro!r} -> training.local_batch_size (same as per_device_train_batch_size)"
        )
    evaluation = imp.given.get("per_device_eval_batch_size")
    if evaluation is not None and evaluation != flat["per_device_train_batch_size"]:
        imp.refuse("per_device_eval_batch_size", "an evaluation micro-batch other than the training one")
    elif evaluation is not None:
        imp.say(f"per_device_eval_batch_size: {evaluation!r} -> the training micro-batch (the same)")


def _schedule(imp: Importer) -> None:
    flat, given, to = imp.flat, imp.given, imp.to
    to("lr_scheduler.learning_rate", flat["learning_rate"], "learning_rate")
    name = flat["lr_scheduler_type"]
    if name not in SCHEDULERS:
        imp.refuse("lr_scheduler_type", f"the {name} schedule; built: {', '.join(SCHEDULERS)}")
        return
    to("lr_scheduler.type", SCHEDULERS[str(name)], "lr_scheduler_type")
    warmup = given.get("warmup_steps")
    if name == "constant":
        for key in ("warmup_steps", "warmup_ratio"):
            if key in given:
                imp.say(f"{key}: {given[key]!r} -> unused: the HF 'constant' schedule has no warm-up")
    elif isinstance(warmup, float) and 0 < warmup < 1:
        to("lr_scheduler.warmup_ratio", warmup, "warmup_steps")  # transformers 5: a float below 1 is a ratio
    elif warmup:
        to("lr_scheduler.warmup_steps", warmup, "warmup_steps")
        if given.get("warmup_ratio"):
            imp.say(
                f"warmup_ratio: {given['warmup_ratio']!r} -> unused: warmup_steps wins (as in the HF Trainer)"
            )
    elif given.get("warmup_ratio"):
        to("lr_scheduler.warmup_ratio", given["warmup_ratio"], "warmup_ratio")
    else:
        to("lr_scheduler.warmup_steps", 0, "warmup_steps")
    kwargs = given.get("lr_scheduler_kwargs")
    if isinstance(kwargs, str) and kwargs.strip().startswith("{"):
        kwargs = json.loads(kwargs)
    if name == "cosine_with_min_lr" and not kwargs:
        imp.issues.append(
            ("lr_scheduler_kwargs", "cosine_with_min_lr needs min_lr or min_lr_rate (as the HF Trainer)")
        )
    if not kwargs:
        return
    if not isinstance(kwargs, dict):
        imp.issues.append(("lr_scheduler_kwargs", f"must be a mapping, got {kwargs!r}"))
        return
    for key, value in kwargs.items():
        if key == "min_lr":
            to("lr_scheduler.lr_end", value, "lr_scheduler_kwargs")
        elif key == "min_lr_rate" and isinstance(flat["learning_rate"], int | float):
            to("lr_scheduler.lr_end", value * flat["learning_rate"], "lr_scheduler_kwargs")
        elif key in ("num_cycles", "power", "lr_end"):
            to(f"lr_scheduler.{key}", value, "lr_scheduler_kwargs")
        else:
            imp.issues.append(
                ("lr_scheduler_kwargs", f"not supported yet: lr_scheduler_kwargs: {key}: {value!r}")
            )


def _optimizer(imp: Importer) -> None:
    flat, given, to = imp.flat, imp.given, imp.to
    optim = given.get("optim")
    if optim is not None and optim not in ADAMW:
        imp.refuse(
            "optim", f"the {optim} optimizer; built here: AdamW ({', '.join(ADAMW)}) and Muon (use_muon)"
        )
    elif optim is not None and flat.get("use_muon") is not True:
        to("optimizer.type", "AdamW", "optim")
    elif optim is not None:
        imp.say(
            f"optim: {optim!r} -> unused: use_muon picks Muon (its AdamW part takes the other parameters)"
        )
    mca = given.get("optimizer")
    if mca is not None and mca != "adam":
        imp.refuse("optimizer", f"mcore_adapter's {mca} optimizer")
    elif mca is not None and flat.get("use_muon") is not True:
        to("optimizer.type", "AdamW", "optimizer")
    elif mca is not None:
        imp.say(f"optimizer: {mca!r} -> unused: use_muon picks Muon")
    to("optimizer.weight_decay", flat["weight_decay"], "weight_decay")
    to("optimizer.betas", [flat.get("adam_beta1", 0.9), flat["adam_beta2"]], "adam_beta2")
    if "adam_beta1" in given:
        imp.say(f"adam_beta1: {given['adam_beta1']!r} -> optimizer.betas[0]")
    _simple(imp, {"adam_epsilon": "optimizer.eps"})


def _saving(imp: Importer) -> None:
    flat, given, to = imp.flat, imp.given, imp.to
    strategy = flat.get("save_strategy", "steps")
    if strategy == "no":
        to("checkpoint.enable_save", False, "save_strategy")
    elif strategy != "steps":
        imp.refuse("save_strategy", "saving by epoch or by best metric")
    else:
        to("checkpoint.save_interleaved_steps", flat["save_steps"], "save_steps")
    to("checkpoint.save_max", flat["save_total_limit"], "save_total_limit")
    _simple(imp, {"save_only_model": "checkpoint.no_save_optim"})
    for key in ("save_hf_model", "save_merged_model"):
        if given.get(key) is True:
            to("checkpoint.save_hf_weights", True, key)
    resume = given.get("resume_from_checkpoint")
    if resume is not None and resume is not False:
        # `true` is the HF Trainer's "the latest checkpoint of output_dir": meshforge's `auto`.
        to("checkpoint.load_path", "auto" if resume is True else resume, "resume_from_checkpoint")


def _evaluation(imp: Importer) -> None:
    given, to = imp.given, imp.to
    strategy = given.get("eval_strategy", "no")
    if strategy == "steps":
        steps = given.get("eval_steps") or imp.flat["logging_steps"]
        to("training.eval_interval", steps, "eval_steps")
        imp.say(
            "eval_strategy: 'steps' -> evaluation every eval_steps and at the end (training.eval_interval)"
        )
    elif strategy != "no":
        imp.refuse("eval_strategy", "evaluation by epoch")
    elif "eval_steps" in given:
        imp.say(
            f"eval_steps: {given['eval_steps']!r} -> unused: eval_strategy is 'no' (evaluation only at the end)"
        )


def _logging(imp: Importer) -> None:
    flat, given, to = imp.flat, imp.given, imp.to
    strategy = given.get("logging_strategy", "steps")
    if strategy != "steps":
        imp.refuse("logging_strategy", "logging by epoch, or no logging")
    to("training.log_interval", flat["logging_steps"], "logging_steps")
    report = given.get("report_to")
    chosen: list[str] = []
    if report is not None:
        names = (
            [report] if isinstance(report, str) else list(report) if isinstance(report, list) else [report]
        )
        if names in (["none"], ["all"]):
            to("monitor.report_to", names[0], "report_to")
            chosen = list(TRACKERS) if names == ["all"] else []
        else:
            unknown = [n for n in names if n not in TRACKERS]
            if unknown:
                imp.refuse("report_to", f"the trackers {unknown}; built: {', '.join(TRACKERS)}")
            chosen = [n for n in names if n in TRACKERS]
            to("monitor.report_to", chosen, "report_to")
    if given.get("use_swanlab") is True and "swanlab" not in chosen:
        chosen.append("swanlab")
        to("monitor.report_to", chosen, "use_swanlab")
    swanlab = {
        "swanlab_project": "project",
        "swanlab_workspace": "workspace",
        "swanlab_run_name": "name",
        "swanlab_mode": "mode",
        "swanlab_logdir": "dir",
    }
    for key, field in swanlab.items():
        if key in given and given[key] is not None:
            to(f"monitor.swanlab.{field}", given[key], key)
    for key, field in (("run_name", "name"), ("project", "project")):
        if key in given and given[key] is not None:
            for tracker in ("wandb", "swanlab"):
                if tracker in chosen:
                    to(f"monitor.{tracker}.{field}", given[key], key)
            if not any(t in chosen for t in ("wandb", "swanlab")):
                imp.say(f"{key}: {given[key]!r} -> unused: no wandb or swanlab tracker")
    if "logging_dir" in given and given["logging_dir"] is not None:
        to("monitor.tensorboard.output_dir", given["logging_dir"], "logging_dir")


def _profiler(imp: Importer) -> None:
    flat, given, to = imp.flat, imp.given, imp.to
    keys = [k for k in given if k.startswith("profiler_")]
    if flat.get("enable_torch_profiler") is not True:
        for key in keys:
            imp.say(f"{key}: {given[key]!r} -> unused: enable_torch_profiler is off")
        return
    to("profiler.enable_profiling", True, "enable_torch_profiler")
    wait, warmup, active = (flat.get(f"profiler_{k}_steps", 1) for k in ("wait", "warmup", "active"))
    if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (wait, warmup, active)):
        start = int(wait) + int(warmup) + 1  # type: ignore[call-overload]
        if "profiler_warmup_steps" in given:
            imp.say(f"profiler_warmup_steps: {warmup!r} -> counted in profiler.start_step")
        to("profiler.start_step", start, "profiler_wait_steps")
        to("profiler.end_step", start + max(int(active), 1) - 1, "profiler_active_steps")  # type: ignore[call-overload]
    else:
        imp.issues.append(
            ("profiler_wait_steps", "profiler_{wait,warmup,active}_steps must be integers >= 0")
        )
    # LLaMA-Factory's defaults for these three are true.
    for key, field in (
        ("record_shapes", "record_shapes"),
        ("profile_memory", "profile_memory"),
        ("with_stack", "with_stack"),
    ):
        to(f"profiler.{field}", flat.get(f"profiler_{key}", True), f"profiler_{key}")
    _simple(imp, {"profiler_output_dir": "profiler.output_path"})


def _recompute(imp: Importer) -> None:
    """LLaMA-Factory checkpoints every decoder layer unless `disable_gradient_checkpointing`."""
    flat, given = imp.flat, imp.given
    if any(k in given for k in ("recompute_granularity", "recompute_method", "recompute_num_layers")):
        return  # the Megatron keys decide (`_megatron`)
    if flat.get("disable_gradient_checkpointing") is True:
        imp.to("recompute.mode", "None", "disable_gradient_checkpointing")
        if given.get("gradient_checkpointing") is True:
            imp.say(
                "gradient_checkpointing: True -> unused: disable_gradient_checkpointing wins (as in LLaMA-Factory)"
            )
        return
    key = "gradient_checkpointing" if "gradient_checkpointing" in given else "disable_gradient_checkpointing"
    imp.to("recompute.mode", "full", key)
    imp.to("recompute.modules", ["model.layers.{*}"], key)


def _zero_config(imp: Importer, value: object) -> dict[str, object] | None:
    if isinstance(value, dict):
        return value
    path = Path(str(value)).expanduser()
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        imp.issues.append(("deepspeed", f"{path}: cannot read the DeepSpeed JSON ({err})"))
        return None
    if not isinstance(body, dict):
        imp.issues.append(("deepspeed", f"{path}: not a JSON object"))
        return None
    return body


def _deepspeed(imp: Importer) -> None:
    """A ZeRO JSON -> FSDP2: what each stage shards, and offload to the CPU."""
    body = _zero_config(imp, imp.given["deepspeed"])
    if body is None:
        return
    zero = body.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    to, say = imp.to, imp.say
    if stage == 3:
        to("parallelism.data_parallel_shard_strategy", "optim_grads_params", "deepspeed")
        say("deepspeed: ZeRO-3 -> FSDP2 full sharding (parameters, gradients and optimizer state)")
    elif stage in (1, 2):
        to("parallelism.data_parallel_shard_strategy", "optim_grads", "deepspeed")
        say(
            f"deepspeed: ZeRO-{stage} -> FSDP2 optim_grads: gradients and optimizer state sharded, weights kept "
            "gathered from forward to backward (the closest FSDP2 setting"
            + (": FSDP2 has no optimizer-only sharding)" if stage == 1 else ")")
        )
    elif stage == 0:
        to("parallelism.data_parallel_shard", 1, "deepspeed")
        say("deepspeed: ZeRO-0 -> replicated data parallelism (data_parallel_shard: 1)")
    else:
        imp.issues.append(("deepspeed", f"zero_optimization.stage must be 0-3, got {stage!r}"))
    if isinstance(zero, dict):
        offload = [
            k
            for k in ("offload_optimizer", "offload_param")
            if isinstance(zero.get(k), dict) and zero[k].get("device") not in (None, "none")
        ]
        if offload:
            to("parallelism.cpu_offload", True, "deepspeed")
            say(
                f"deepspeed: {' and '.join(offload)} -> FSDP2 CPU offload of parameters, gradients and optimizer state"
            )
    say(
        "deepspeed: batch sizes, precision and the optimizer come from this file's own keys ('auto' in the JSON)"
    )


def _sharding(imp: Importer) -> None:
    given, to = imp.given, imp.to
    if "deepspeed" in given and given["deepspeed"] is not None:
        _deepspeed(imp)
    fsdp = given.get("fsdp")
    if fsdp:
        options = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, list) else [fsdp]
        for option in options:
            if option == "full_shard":
                to("parallelism.data_parallel_shard_strategy", "optim_grads_params", "fsdp")
            elif option == "shard_grad_op":
                to("parallelism.data_parallel_shard_strategy", "optim_grads", "fsdp")
            elif option == "offload":
                to("parallelism.cpu_offload", True, "fsdp")
            elif option == "auto_wrap":
                imp.say("fsdp: 'auto_wrap' -> meshforge wraps each decoder layer (its default)")
            else:
                imp.issues.append(
                    (
                        "fsdp",
                        f"not supported yet: fsdp: {option} (built: full_shard, shard_grad_op, offload, auto_wrap)",
                    )
                )
    config = given.get("fsdp_config")
    if isinstance(config, dict):
        for key, value in config.items():
            if key in ("offload_params", "cpu_offload") and value is True:
                to("parallelism.cpu_offload", True, "fsdp_config")
            else:
                imp.say(
                    f"fsdp_config: {key}: {value!r} -> no effect: meshforge wraps each decoder layer with FSDP2"
                )
    elif config is not None:
        imp.say(f"fsdp_config: {config!r} -> no effect: meshforge wraps each decoder layer with FSDP2")


def _megatron(imp: Importer) -> None:
    """The Megatron keys of LLaMA-Factory's MCA path (mcore_adapter) in their native homes."""
    given, to = imp.given, imp.to
    _simple(
        imp,
        {
            "tensor_model_parallel_size": "parallelism.tensor_parallel",
            "pipeline_model_parallel_size": "parallelism.pipeline_parallel",
            "virtual_pipeline_model_parallel_size": "parallelism.pipeline_parallel_interleave_num",
            "context_parallel_size": "parallelism.context_parallel",
            "expert_model_parallel_size": "parallelism.expert_parallel",
            "moe_aux_loss_coeff": "training.router_aux_loss_coef",
            "moe_grouped_gemm": "kernels.moe_grouped_gemm",
            "calculate_per_token_loss": "training.calculate_per_token_loss",
            "use_flash_attn": "kernels.use_flash_attn",
            "accumulate_allreduce_grads_in_fp32": "optimizer.accumulate_allreduce_grads_in_fp32",
            "optimizer_cpu_offload": "parallelism.cpu_offload",
            "sequence_packing": "train_dataset.neat_packing",
        },
    )
    tp = given.get("tensor_model_parallel_size") or 1
    if "sequence_parallel" in given:
        if given["sequence_parallel"] is False and tp == 1:
            imp.say("sequence_parallel: False -> nothing to set (no tensor parallelism)")
        else:
            to("parallelism.sequence_parallel", given["sequence_parallel"], "sequence_parallel")
    dispatcher = given.get("moe_token_dispatcher_type")
    if dispatcher == "alltoall":
        to("parallelism.moe_token_dispatcher_type", "alltoall", "moe_token_dispatcher_type")
    elif dispatcher == "allgather":
        imp.say(
            "moe_token_dispatcher_type: 'allgather' -> meshforge's all-to-all exchange (the same tokens reach each expert)"
        )
    elif dispatcher is not None:
        imp.issues.append(("moe_token_dispatcher_type", f"must be allgather or alltoall, got {dispatcher!r}"))
    if given.get("use_distributed_optimizer") is not None:
        imp.say(
            f"use_distributed_optimizer: {given['use_distributed_optimizer']!r} -> already so: FSDP2 shards the "
            "optimizer state (and gradients and weights)"
        )
    keys = ("recompute_granularity", "recompute_method", "recompute_num_layers")
    if any(k in given for k in keys):
        for key in keys:
            if key in given:
                imp.say(f"{key}: {given[key]!r} -> recompute (Megatron's rules, below)")
        flat = {k: given.get(k) for k in keys}
        if flat["recompute_method"] == "recompute":
            flat["recompute_method"] = "block"  # mcore_adapter's name for Megatron's block method
        if flat["recompute_granularity"] == "full" and flat["recompute_method"] is None:
            imp.to("recompute.mode", "full", "recompute_granularity")  # mcore_adapter: every layer
            imp.to("recompute.modules", ["model.layers.{*}"], "recompute_granularity")
            return
        megatron_recompute(flat, imp.to, imp.say, imp.issues)
