"""Hugging Face exports of a run: at its end (`checkpoint.save_hf_weights`) and of any saved step.

`dcp_to_hf` (also `meshforge convert --to hf`) rebuilds the model a run trained from the run's
resolved `config.yaml`, loads a DCP step folder into it and writes a HF folder (config.json,
sharded safetensors with an index, tokenizer files); a LoRA run's step also gets its PEFT
adapter folder. It lives with the trainer because it needs what a run is made of (its config,
tokenizer, LoRA settings), which the checkpoint package does not import.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from meshforge.checkpoint.dcp_reader import load_dcp, read_dcp_metadata
from meshforge.checkpoint.hf import save_hf
from meshforge.checkpoint.manager import resolve_load_path
from meshforge.checkpoint.offline import build_on_cpu, one_rank_group
from meshforge.checkpoint.source import grown_options, resolve_model_source
from meshforge.utils import distributed as dist_utils

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.checkpoint.source import ModelSource
    from meshforge.config.root import TrainConfig
    from meshforge.models.config import LoraConfig, ModelConfig
    from meshforge.models.registry import FamilySpec
    from meshforge.train.run import Run

Log = Callable[[str], None]


def export_hf_from_memory(
    model: nn.Module,
    family: FamilySpec,
    out_dir: Path,
    *,
    tokenizer: PreTrainedTokenizerBase | None,
    log: Callable[[str], None],
) -> Path:
    """Write the current weights, config and tokenizer as a HF folder (collective: FSDP gathers)."""
    save_hf(model, family, out_dir, tokenizer=tokenizer)
    log(f"checkpoint: exported Hugging Face weights to {out_dir} (checkpoint.save_hf_weights)")
    return out_dir


def export_hf_from_checkpoint(
    checkpoint: Path | None,
    out_dir: Path,
    *,
    config_path: Path,
    is_main: bool,
    log: Callable[[str], None],
) -> Path:
    """HF export of a pipeline run: rank 0 reads the final checkpoint whole; the others wait.

    Each stage holds only its own layers, so no rank can gather the model from memory; the
    checkpoint saved at the last step (always, when saving is on) holds all of it.
    """
    if checkpoint is None:
        raise RuntimeError("checkpoint.save_hf_weights: no checkpoint was saved to export from")
    if is_main:
        dcp_to_hf(checkpoint, out_dir, config_path=config_path, log=log)
    dist_utils.barrier()
    log(f"checkpoint: exported Hugging Face weights to {out_dir} (checkpoint.save_hf_weights)")
    return out_dir


def export_lora_from_memory(
    model: nn.Module,
    family: FamilySpec,
    output_dir: Path,
    *,
    adapter_dir: Path | None = None,
    section: LoraConfig,
    base_model: str | None,
    merged: bool,
    tokenizer: PreTrainedTokenizerBase | None,
    log: Callable[[str], None],
) -> Path:
    """A LoRA run's exports (collective): the PEFT adapter folder (`adapter_dir`, default
    `{output_dir}/adapter`), and with `checkpoint.save_hf_weights` the merged Hugging Face folder
    `{output_dir}/hf`."""
    from meshforge.lora.peft_io import save_merged_hf, save_peft_adapter
    from meshforge.lora.settings import lora_settings

    adapter = save_peft_adapter(
        model,
        family,
        adapter_dir or output_dir / "adapter",
        settings=lora_settings(section),
        base_model=base_model or "",
    )
    log(f"lora: wrote the PEFT adapter folder {adapter}")
    if merged:
        out = save_merged_hf(model, family, output_dir / "hf", tokenizer=tokenizer)
        log(
            f"checkpoint: exported Hugging Face weights with the adapters merged to {out} (checkpoint.save_hf_weights)"
        )
        return out
    return adapter


def export_dir(run: Run, default: str) -> Path:
    """Where a run's end-of-run export goes: `checkpoint.export_dir` (LLaMA-Factory's layout: the
    run folder itself), else `{output_dir}/<default>`."""
    chosen = run.env.cfg.checkpoint.export_dir
    return Path(chosen).expanduser() if chosen else run.env.output_dir / default


def export_run_hf(run: Run, out_dir: Path, *, log: Log) -> Path:
    """A run's Hugging Face folder of its current weights (collective; rank 0 writes the tokenizer).

    A pipeline run's comes from its final checkpoint (`export_hf_from_checkpoint`).
    """
    env, parts = run.env, run.model
    if env.cfg.training.stage == "rm":  # a reward model: AutoModelForSequenceClassification's folder
        return export_reward(run, out_dir, merge_adapters=False, log=log)
    if parts.pipeline_split is not None:
        return export_hf_from_checkpoint(
            run.watch.checkpoint_saver.last_path,
            out_dir,
            config_path=env.output_dir / "config.yaml",
            is_main=env.dist.is_main,
            log=log,
        )
    return export_hf_from_memory(
        parts.module, parts.family, out_dir, tokenizer=parts.tokenizer if env.dist.is_main else None, log=log
    )


def export_run_lora(run: Run, *, merged: bool, log: Log) -> Path | None:
    """A LoRA run's PEFT adapter folder, and with `merged` the merged HF folder (returned; else None)."""
    env, parts, section = run.env, run.model, run.env.cfg.lora_config
    assert section is not None
    reward = env.cfg.training.stage == "rm"  # its merged folder is written by export_reward
    out = export_lora_from_memory(
        parts.module,
        parts.family,
        env.output_dir,
        adapter_dir=export_dir(run, "adapter"),
        section=section,
        base_model=run.optim.checkpointer.lora_base_path() or env.cfg.model.model_name_or_path,
        merged=merged and not reward,
        tokenizer=parts.tokenizer if env.dist.is_main else None,
        log=log,
    )
    if merged and reward:
        return export_reward(run, env.output_dir / "hf", merge_adapters=True, log=log)
    return out if merged else None


def export_reward(run: Run, out_dir: Path, *, merge_adapters: bool, log: Log) -> Path:
    """A reward model's sequence-classification folder of its current weights (collective)."""
    from meshforge.train.reward_export import save_reward_hf

    env, parts = run.env, run.model
    tokenizer = parts.tokenizer if env.dist.is_main else None
    out = save_reward_hf(
        parts.module, parts.family, out_dir, tokenizer=tokenizer, merge_adapters=merge_adapters
    )
    log(
        f"checkpoint: exported the reward model (AutoModelForSequenceClassification) to {out} (checkpoint.save_hf_weights)"
    )
    return out


def dcp_to_hf(
    step_dir: str | Path,
    out_dir: str | Path,
    *,
    config_path: str | Path | None = None,
    shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Export a DCP step folder of a meshforge run as a Hugging Face folder.

    Args:
        step_dir: A complete step folder, or a run / checkpoints folder (its latest complete step).
        out_dir: Destination HF folder.
        config_path: The run's resolved config; default ``step_dir/../../config.yaml`` (the run
            folder's copy when checkpoints live in ``{output_dir}/checkpoints``).
        shard_size: Largest safetensors shard (``"5GB"``, bytes, ...).
        dtype: Cast weights to this dtype (default: the run's ``model.params_dtype``).
        log: Progress sink.

    Raises:
        FileNotFoundError: When the step folder or the config is missing (names the path and the
            ``--config`` option).
        ValueError: The run folder's own config sets ``model.trust_remote_code`` (only a config
            passed as ``config_path`` may), or a file of the step is refused (docs/security.md).
    """
    from meshforge.config import load_config
    from meshforge.utils.dtype import parse_dtype

    try:
        step = resolve_load_path(step_dir)
    except FileNotFoundError as err:
        # The resolver speaks of the config key; here the folder came from the command line.
        raise FileNotFoundError(str(err).replace("checkpoint.load_path: ", "convert: ", 1)) from None
    read_dcp_metadata(step)
    cfg_file = Path(config_path) if config_path else step.parent.parent / "config.yaml"
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"{cfg_file}: the run's config.yaml was not found; pass it with --config "
            "(it describes the model the checkpoint holds)"
        )
    cfg = load_config(str(cfg_file), [])
    if config_path is None and cfg.model.trust_remote_code:
        # The config came with the checkpoint: it may not switch on code from a model folder.
        raise ValueError(
            f"{cfg_file}: sets model.trust_remote_code: true; a checkpoint's own config never runs a "
            "model folder's code: read it, then pass it yourself with --config"
        )
    source = resolve_model_source(cfg.model, log=log)
    params_dtype = parse_dtype(cfg.model.params_dtype, key="model.params_dtype")
    tokenizer = _maybe_tokenizer(cfg.model, log)
    options = grown_options(cfg.model, source, tokenizer, log)
    if cfg.training.stage == "rm":  # a reward model: AutoModelForSequenceClassification's folder
        from meshforge.train.reward_export import reward_step_to_hf

        return reward_step_to_hf(
            cfg,
            source,
            options,
            step,
            Path(out_dir),
            tokenizer=tokenizer,
            params_dtype=params_dtype,
            shard_size=shard_size,
            dtype=dtype,
            log=log,
        )
    if cfg.lora_config is not None:
        return _lora_step_to_hf(cfg, source, options, step, Path(out_dir), tokenizer, params_dtype, log)
    with one_rank_group():
        model = build_on_cpu(source.family, options, params_dtype)
        state = {"model": get_model_state_dict(model)}
        # Read by this process alone: a training run exports from rank 0 while the others wait.
        load_dcp(state, step, no_dist=True)
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
        out = save_hf(
            model,
            source.family,
            out_dir,
            tokenizer=tokenizer,
            shard_size=shard_size,
            dtype=dtype,
            collective=False,
        )
    log(f"convert: wrote {out} (Hugging Face {source.family.name}) from {step}")
    return out


def _lora_step_to_hf(
    cfg: TrainConfig,
    source: ModelSource,
    options: dict[str, object],
    step: Path,
    out: Path,
    tokenizer: PreTrainedTokenizerBase | None,
    dtype: torch.dtype,
    log: Callable[[str], None],
) -> Path:
    """A LoRA run's step: the merged HF folder in `out` and the PEFT adapter in `out/adapter`."""
    from meshforge.checkpoint.manager import read_trainer_state
    from meshforge.lora.offline import build_adapted, load_lora_step, lora_record
    from meshforge.lora.peft_io import save_merged_hf, save_peft_adapter
    from meshforge.lora.settings import lora_settings

    assert cfg.lora_config is not None
    record = lora_record(read_trainer_state(step))
    if record is None:
        raise ValueError(
            f"convert: {step} holds a full model but its config has lora_config; remove it from --config"
        )
    settings = lora_settings(cfg.lora_config)
    cpu = torch.device("cpu")
    with one_rank_group():
        model = build_adapted(source.family, options, settings, dtype=dtype, device=cpu)
        load_lora_step(
            model, source.family, step, record, settings=settings, seed=cfg.training.seed, device=cpu, log=log
        )
        base = record.get("base", {})
        base_name = str(base.get("path", "")) if isinstance(base, dict) else ""
        save_peft_adapter(model, source.family, out / "adapter", settings=settings, base_model=base_name)
        save_merged_hf(model, source.family, out, tokenizer=tokenizer, collective=False)
    log(
        f"convert: wrote {out} (Hugging Face {source.family.name}, adapters merged) and the PEFT adapter {out / 'adapter'} from {step}"
    )
    return out


def _maybe_tokenizer(model_cfg: ModelConfig, log: Callable[[str], None]) -> PreTrainedTokenizerBase | None:
    from meshforge.data.tokenizer import build_tokenizer, extension_options

    name = model_cfg.tokenizer_name_or_path or model_cfg.model_name_or_path
    if not name:
        log("convert: warning: the config names no tokenizer; no tokenizer files written")
        return None
    try:
        # The run's added tokens (model.add_tokens, ...) belong to the checkpoint's vocabulary.
        return build_tokenizer(name, use_fast=model_cfg.use_fast_tokenizer, **extension_options(model_cfg))
    except (OSError, ValueError) as err:
        log(f"convert: warning: tokenizer {name!r} not loaded ({err}); no tokenizer files written")
        return None
