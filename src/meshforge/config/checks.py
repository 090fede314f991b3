"""Checks beyond loading: component passthrough keys, essentials, world size, features not built.

`validate_config` (for `meshforge config validate`) sorts findings into errors and warnings;
`check_trainable` (called by `meshforge train` before anything heavy) turns everything that would
make the run wrong into one ConfigError. Components are imported lazily and only through their
light spec modules; a component that is missing is reported as "cannot check", never as valid.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from meshforge.config.base import ConfigError, Issue
from meshforge.config.noops import noop_notes
from meshforge.config.root import TrainConfig
from meshforge.config.rules import layer_issues
from meshforge.config.unsupported import unsupported_entries

logger = logging.getLogger("meshforge.config")


@dataclass
class Report:
    """Findings of a full check: errors make a config unusable, warnings do not."""

    errors: list[Issue] = field(default_factory=list)
    warnings: list[Issue] = field(default_factory=list)


def _component_issues(cfg: TrainConfig) -> tuple[list[Issue], list[Issue]]:
    """(issues reported by components for passthrough keys, components that could not check)."""
    found: list[Issue] = []
    unchecked: list[Issue] = []

    def ask(section: str, check: Callable[[], list[Issue]]) -> None:
        try:
            reported = check()
        except ImportError as exc:
            unchecked.append((section, f"component not available, passthrough keys not checked ({exc})"))
            return
        except Exception as exc:  # a component bug must not turn `config validate` into a traceback
            unchecked.append((section, f"passthrough check failed ({type(exc).__name__}: {exc})"))
            return
        for key, reason in reported:
            found.append((f"{section}.{key}" if key else section, reason))

    def model_options() -> list[Issue]:
        from meshforge.models.registry import check_model_options

        model = cfg.model
        return check_model_options(
            model.model_type, model.architectures, model.model_id, dict(model.model_extra or {})
        )

    def dataloader_options() -> list[Issue]:
        # Parsed once, when the section was validated (meshforge.data.specs has the models).
        return cfg.train_dataset.dataloader.option_issues()

    def optimizer_options() -> list[Issue]:
        from meshforge.optim.specs import check_optimizer_options

        return check_optimizer_options(cfg.optimizer.type, dict(cfg.optimizer.model_extra or {}))

    def scheduler_options() -> list[Issue]:
        from meshforge.optim.specs import check_scheduler_options

        return check_scheduler_options(cfg.lr_scheduler.type, dict(cfg.lr_scheduler.model_extra or {}))

    ask("model", model_options)
    ask("train_dataset.dataloader", dataloader_options)
    ask("optimizer", optimizer_options)
    ask("lr_scheduler", scheduler_options)
    return found, unchecked


def _essentials(cfg: TrainConfig) -> list[Issue]:
    issues = []
    model = cfg.model
    if not (model.model_type or model.model_name_or_path or model.architectures or model.model_id):
        issues.append(
            ("model", "no model given: set model.model_type (e.g. qwen3) or model.model_name_or_path")
        )
    lora = cfg.lora_config
    if lora is not None and isinstance(lora.target_modules, str) and not lora.target_modules.strip():
        issues.append(
            (
                "lora_config.target_modules",
                "empty: give a regex over module paths (e.g. '.*(q_proj|v_proj)'), a list of module names, or all",
            )
        )
    if not cfg.train_dataset.dataloader.type:
        issues.append(
            (
                "train_dataset.dataloader.type",
                "no data loader type given: set it, e.g. TextDataLoader with data_path and seq_length",
            )
        )
    return issues


def num_layers_from_model_dir(cfg: TrainConfig) -> tuple[int | None, str]:
    """Layer count from `model.num_hidden_layers`, else from `<model_name_or_path>/config.json`."""
    known = cfg.model.num_hidden_layers()
    if known is not None:
        return known, "model.num_hidden_layers"
    name = cfg.model.model_name_or_path
    if not name:
        return None, ""
    path = Path(name).expanduser() / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return None, ""
    value = data.get("num_hidden_layers") if isinstance(data, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value, str(path)
    return None, ""


def _split_path(message: str, default: str) -> Issue:
    """`parallelism.x: reason` -> ("parallelism.x", "reason"); other messages stay under `default`."""
    head, sep, rest = message.partition(": ")
    if sep and head.replace(".", "").replace("_", "").isalnum() and "." in head or head == default:
        return head, rest
    return default, message


def world_size_issues(cfg: TrainConfig, world_size: int) -> tuple[list[Issue], list[Issue]]:
    """Degrees against `world_size` via ParallelDims, and dp * local_batch_size <= global_batch_size."""
    errors: list[Issue] = []
    warnings: list[Issue] = []
    par = cfg.parallelism
    try:
        from meshforge.parallel.dims import ParallelDims
    except ImportError as exc:
        warnings.append(
            ("parallelism", f"ParallelDims not available; only the basic degree check ran ({exc})")
        )
        others = par.tensor_parallel * par.context_parallel * par.pipeline_parallel
        if world_size % others:
            errors.append(
                ("parallelism", f"world size {world_size} is not divisible by tp x cp x pp = {others}")
            )
            return errors, warnings
        dp = world_size // others
    else:
        try:
            dp = ParallelDims.from_config(par, world_size).dp
        except ValueError as exc:
            errors.append(_split_path(str(exc), "parallelism"))
            return errors, warnings
    try:
        cfg.training.accumulation_steps(dp)
    except ValueError as exc:
        errors.append(_split_path(str(exc), "training.global_batch_size"))
    return errors, warnings


def _dedupe(issues: list[Issue]) -> list[Issue]:
    """Drop a second issue on the same key path (two checkers often spot the same missing key)."""
    seen: set[str] = set()
    out = []
    for path, reason in issues:
        if path not in seen:
            seen.add(path)
            out.append((path, reason))
    return out


def validate_config(cfg: TrainConfig, *, world_size: int | None = None) -> Report:
    """Every rule `check_trainable` applies, without raising: what it refuses is an error here
    too (a feature not built yet, a missing model or data loader, a key a component does not
    take, a layer spec out of range); no-ops and unchecked passthrough keys warn. The paths a
    run reads are checked by `meshforge.data.inputs` (`config validate` and the trainer call it).
    """
    report = Report()
    num_layers, source = num_layers_from_model_dir(cfg)
    if num_layers is not None and source != "model.num_hidden_layers":
        # Layers known only from config.json: the load-time rules could not check them.
        report.errors += [(p, f"{r} (layer count from {source})") for p, r in layer_issues(cfg, num_layers)]
    if world_size is not None:
        errors, warnings = world_size_issues(cfg, world_size)
        report.errors += errors
        report.warnings += warnings
    found, unchecked = _component_issues(cfg)
    report.errors += _essentials(cfg) + found
    report.warnings += unchecked
    report.warnings += noop_notes(cfg, cfg.context.device())
    report.errors += [(e.path, f"not supported yet: {e.path} ({e.note})") for e in unsupported_entries(cfg)]
    report.errors = _dedupe(report.errors)
    report.warnings = _dedupe(report.warnings)
    return report


def check_trainable(
    cfg: TrainConfig, *, world_size: int | None = None, log: Callable[[str], None] | None = None
) -> None:
    """Refuse a config that `meshforge train` cannot run as written.

    Raises:
        ConfigError: "not supported yet: <key path>" for each feature not built, passthrough keys
            that no component declares, a missing model or data loader type, layer specs out of range.
    """
    issues: list[Issue] = [
        (e.path, f"not supported yet: {e.path} ({e.note})") for e in unsupported_entries(cfg)
    ]
    issues += _essentials(cfg)
    found, unchecked = _component_issues(cfg)
    issues += found
    warn = log or logger.warning
    for path, reason in unchecked + noop_notes(cfg, cfg.context.device()):
        warn(f"warning: {path}: {reason}")
    num_layers, source = num_layers_from_model_dir(cfg)
    if num_layers is not None and source != "model.num_hidden_layers":
        issues += layer_issues(cfg, num_layers)
    if world_size is not None:
        errors, warnings = world_size_issues(cfg, world_size)
        issues += errors
        for path, reason in warnings:
            warn(f"warning: {path}: {reason}")
    if issues:
        raise ConfigError(_dedupe(issues))
