"""The TrainingArguments part of the MindSpeed importer (`config/importer.py`): optimizer,
schedule, run length, saving and profiling keys."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

from meshforge.config.base import Issue

Flat = dict[str, object]
To = Callable[[str, object, str], None]  # (native path, value, MindSpeed key)
Say = Callable[[str], None]
T = TypeVar("T")


class Choice(Protocol):
    """(MindSpeed key, table) -> the table's value for the key's value, or None (an issue is recorded)."""

    def __call__(self, key: str, table: Mapping[str, T], /) -> T | None: ...


SCHEDULERS = {"cosine": "CosineWithWarmUpLR", "linear": "LinearWithWarmUpLR", "constant": "ConstantWarmUpLR"}
OPTIMIZERS = {"adamw": "AdamW", "muon": "Muon", "fused_adamw": "FusedAdamW"}
PROFILE_LEVELS = {"level_none": 0, "level0": 0, "level1": 1, "level2": 2}


def training(flat: Flat, given: Flat, to: To, choice: Choice, say: Say, issues: list[Issue]) -> None:
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
    _save_interval(flat, given, to, say)
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
    resume = flat.get("resume_from_checkpoint")
    if resume is not None and resume is not False:
        # `true` is the HF Trainer's "the latest checkpoint of output_dir": meshforge's `auto`
        # (which also starts fresh when there is none, so a restarted job can always pass it).
        to("checkpoint.load_path", "auto" if resume is True else resume, "resume_from_checkpoint")
    if "dataloader_prefetch_factor" in flat and flat["dataloader_prefetch_factor"] is not None:
        to("train_dataset.prefetch_size", flat["dataloader_prefetch_factor"], "dataloader_prefetch_factor")
    if "profile_level" in flat:
        level = choice("profile_level", PROFILE_LEVELS)
        if level is not None:
            to("profiler.profiler_level", level, "profile_level")
    if "profile_ranks" in flat:
        given_ranks = flat["profile_ranks"]
        ranks = given_ranks if isinstance(given_ranks, list) else [given_ranks]
        to("profiler.profiler_rank", None if -1 in ranks else ranks, "profile_ranks")
    _profile_window(flat, to, issues)


def _save_interval(flat: Flat, given: Flat, to: To, say: Say) -> None:
    """`save_steps` / `save_epochs` as MindSpeed's trainer reads them.

    It saves at step s when `save_steps > 0 and s % save_steps == 0`, and at the end of an epoch
    (the last one included, also when max_steps ends it early) when `save_epochs` is truthy and
    divides the epoch number. So `save_steps <= 0` means no interval saves, and with
    `save_epochs: 0` as well the run saves no checkpoint at all.
    """
    steps = flat["save_steps"]
    epochs = flat.get("save_epochs")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps > 0:
        to("checkpoint.save_interleaved_steps", steps, "save_steps")
    elif epochs == 0:
        to("checkpoint.enable_save", False, "save_steps")
        say("save_steps/save_epochs: 0 and 0 -> no checkpoint is saved (as in MindSpeed)")
        return
    else:
        to("checkpoint.save_interleaved_steps", None, "save_steps")
        if "save_epochs" not in given:
            say(
                "save_epochs -> MindSpeed's default 1 saves at each epoch end; meshforge saves the final "
                "step only (set checkpoint.save_epochs for epoch saves)"
            )
    if epochs == 0:
        say("save_epochs: 0 -> no epoch-end saves (checkpoint.save_epochs stays unset)")
    elif "save_epochs" in flat:
        to("checkpoint.save_epochs", epochs, "save_epochs")


def _profile_window(flat: Flat, to: To, issues: list[Issue]) -> None:
    """MindSpeed: start (inclusive, >= 0) .. end (exclusive, -1 = to the end); native: 1-based inclusive."""
    if "profile_step_start" not in flat and "profile_step_end" not in flat:
        return
    start = flat.get("profile_step_start", 0)
    end = flat.get("profile_step_end", -1)
    if not (
        isinstance(start, int)
        and not isinstance(start, bool)
        and isinstance(end, int)
        and not isinstance(end, bool)
    ):
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
