"""A LoRA step folder rebuilt outside training (`meshforge convert`, `meshforge generate`).

The step holds the adapters only; its `lora.base` names the base weights, which are loaded
first (a Hugging Face folder, a full DCP step, or the seeded random init of a run that trained
adapters on a freshly initialised model), after checking the base's hash.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    ValueType,
    get_model_state_dict,
    set_model_state_dict,
)

from meshforge.checkpoint.dcp_reader import load_dcp
from meshforge.checkpoint.lora_base import adapter_state_dict, base_state_dict, check_base
from meshforge.lora.apply import LoraSettings, with_adapter_init
from meshforge.lora.layer import adapters_detached

if TYPE_CHECKING:
    from meshforge.checkpoint.manager import TrainerState
    from meshforge.checkpoint.source import ModelSource
    from meshforge.config.root import TrainConfig
    from meshforge.models.materialize import InitFn
    from meshforge.models.registry import FamilySpec


def lora_record(trainer_state: TrainerState) -> dict[str, object] | None:
    """The `lora` entry of a step's trainer state (None: a full-model step)."""
    record = trainer_state.get("lora")
    return record if isinstance(record, dict) else None


def _dcp_load(state: dict[str, dict[str, ValueType]], step: Path) -> None:
    load_dcp(state, step, no_dist=not dist.is_initialized())


@torch.no_grad()
def load_lora_step(
    model: nn.Module,
    family: FamilySpec,
    step: Path,
    record: dict[str, object],
    *,
    settings: LoraSettings,
    seed: int,
    device: torch.device,
    log: Callable[[str], None],
) -> None:
    """Fill an adapted, unsharded model (storage allocated) with a LoRA step's base and adapters.

    Raises:
        FileNotFoundError / ValueError: the base is gone or changed (named with the step folder).
    """
    from meshforge.checkpoint.hf import load_hf_weights
    from meshforge.models.materialize import materialize_and_init

    base = record.get("base") if isinstance(record.get("base"), dict) else {"kind": "init"}
    assert isinstance(base, dict)
    kind = base.get("kind")
    where = step / "trainer_state.json"
    if kind == "init":
        materialize_and_init(
            model,
            device=device,
            seed=seed,
            init_fn=with_adapter_init(cast("InitFn", model.init_full_parameter_), settings),
        )
        log(f"lora: base weights re-drawn from training.seed {seed} (the run trained on a random init)")
    elif kind == "hf":
        folder = check_base(base, where)
        with adapters_detached(model):
            load_hf_weights(model, family, folder)
        log(f"lora: base weights from {folder}")
    else:
        folder = check_base(base, where)
        state = {"model": base_state_dict(get_model_state_dict(model))}
        _dcp_load(state, folder)
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
        log(f"lora: base weights from {folder}")
    state = {"model": adapter_state_dict(get_model_state_dict(model))}
    _dcp_load(state, step)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    log(f"lora: {len(state['model'])} adapter matrices from {step}")


def build_adapted(
    family: FamilySpec,
    options: dict[str, object],
    settings: LoraSettings,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> nn.Module:
    """The family's model with adapters, storage allocated on `device` (contents unset)."""
    from meshforge.lora.apply import apply_lora
    from meshforge.models.materialize import reset_buffers, to_empty_keeping_ties

    with torch.device("meta"):
        model = family.build(options)
    model.to(dtype=dtype)
    apply_lora(model, settings, adapter_dtype=dtype)
    to_empty_keeping_ties(model, device)
    reset_buffers(model)
    return model


def load_for_generation(
    cfg: TrainConfig,
    source: ModelSource,
    options: dict[str, object],
    step: Path | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    log: Callable[[str], None],
) -> nn.Module:
    """The base model with the trained adapters merged in, for `meshforge generate`.

    The adapters come from `step` (a LoRA run's step folder) or, without one, from
    `lora_config.adapter_path` (a PEFT folder) on the `model.model_name_or_path` base.
    """
    from meshforge.checkpoint.hf import load_hf_weights
    from meshforge.checkpoint.manager import read_trainer_state
    from meshforge.lora.layer import merge_adapters_
    from meshforge.lora.peft_io import load_peft_adapter
    from meshforge.lora.settings import lora_settings

    assert cfg.lora_config is not None
    settings = lora_settings(cfg.lora_config)
    record = lora_record(read_trainer_state(step)) if step is not None else None
    if step is not None and record is None:
        raise ValueError(
            f"checkpoint.load_path: {step} holds a full model, not LoRA adapters; remove lora_config to generate from it"
        )
    model = build_adapted(source.family, options, settings, dtype=torch.float32, device=device)
    if step is not None and record is not None:
        load_lora_step(
            model,
            source.family,
            step,
            record,
            settings=settings,
            seed=cfg.training.seed,
            device=device,
            log=log,
        )
    else:
        if source.hf_dir is None or not cfg.lora_config.adapter_path:
            raise ValueError(
                "lora_config.adapter_path: generation with lora_config needs a LoRA step (checkpoint.load_path) "
                "or a PEFT adapter folder here, on the model.model_name_or_path base"
            )
        from meshforge.utils.resources import resolve_path

        with adapters_detached(model):
            load_hf_weights(model, source.family, source.hf_dir, log=log)
        load_peft_adapter(
            model, source.family, resolve_path(cfg.lora_config.adapter_path), settings=settings, log=log
        )
    merged = merge_adapters_(model)
    log(f"generate: {merged} LoRA adapters merged into the base weights")
    return model.to(dtype=dtype)
