"""The model and tokenizer `meshforge generate` runs: from a HF folder or a DCP step, optionally FSDP-sharded.

With ``lora_config`` the adapters (a LoRA step's, or a PEFT folder's from
``lora_config.adapter_path``) are merged into the base weights, so generation runs a plain model.
Weights come as in training: ``checkpoint.load_path`` (a DCP step folder, or a run folder's latest
step) when set, else ``model.model_name_or_path``'s safetensors, through the same resolver, builder
and loaders as the trainer and ``meshforge convert``. Weights are held in ``model.compute_dtype``
(the dtype training computes in). With several processes every layer and the root are
``fully_shard``-ed over all ranks: each rank keeps 1/N of the weights and all-gathers a layer for
its forward, so a model too large for one device still generates.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.config.root import TrainConfig
    from meshforge.models.spec import FamilySpec

Log = Callable[[str], None]


@dataclass
class GenerationModel:
    """What was loaded: the model (eval mode, on its device), its family, tokenizer and weight source."""

    model: nn.Module
    family: FamilySpec
    tokenizer: PreTrainedTokenizerBase
    hf_dir: Path | None
    step_dir: Path | None
    dtype: torch.dtype


def load_tokenizer(cfg: TrainConfig, log: Log) -> PreTrainedTokenizerBase:
    """The run's tokenizer (with the tokens the config adds), or an error naming the keys."""
    from meshforge.data.tokenizer import build_tokenizer, extension_options

    name = cfg.model.tokenizer_name_or_path or cfg.model.model_name_or_path
    if not name:
        raise ValueError(
            "model.tokenizer_name_or_path: generation needs a tokenizer; set it (or model.model_name_or_path)"
        )
    return build_tokenizer(
        name, use_fast=cfg.model.use_fast_tokenizer, log=log, **extension_options(cfg.model)
    )


def load_generation_model(
    cfg: TrainConfig, device: torch.device, log: Log, tokenizer: PreTrainedTokenizerBase | None = None
) -> GenerationModel:
    """Build the config's model on ``device`` with its trained weights.

    Raises:
        ValueError: When the config names no weights (neither ``checkpoint.load_path`` nor
            ``model.model_name_or_path``).
        FileNotFoundError: For a missing folder, naming the key.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from meshforge.checkpoint.dcp_reader import load_dcp
    from meshforge.checkpoint.hf import load_hf_weights
    from meshforge.checkpoint.manager import resolve_load_path
    from meshforge.checkpoint.source import grown_options, resolve_model_source
    from meshforge.models.materialize import to_empty_keeping_ties
    from meshforge.utils.dtype import parse_dtype

    dtype = parse_dtype(cfg.model.compute_dtype, key="model.compute_dtype")
    source = resolve_model_source(cfg.model, log=log)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg, log)
    step = resolve_load_path(cfg.checkpoint.load_path) if cfg.checkpoint.load_path else None
    if step is None and source.hf_dir is None:
        raise ValueError(
            "checkpoint.load_path: generation needs trained weights; set it (a DCP step or run folder) "
            "or model.model_name_or_path (a Hugging Face folder)"
        )
    options = grown_options(cfg.model, source, tokenizer, log) if step is not None else dict(source.options)
    if cfg.lora_config is not None:
        from meshforge.lora.offline import load_for_generation

        model = load_for_generation(cfg, source, options, step, dtype=dtype, device=device, log=log)
        return GenerationModel(
            model.eval(), source.family, tokenizer, source.hf_dir, step or source.hf_dir, dtype
        )
    with torch.device("meta"):
        model = source.family.build(options)
    model.to(dtype=dtype)
    to_empty_keeping_ties(model, device)
    reset = getattr(model, "reset_buffers", None)
    if callable(reset):
        reset()  # non-persistent buffers (rotary tables of the generic path) are not in any checkpoint
    if step is not None:
        state = {"model": get_model_state_dict(model)}
        load_dcp(state, step, no_dist=not dist.is_initialized())
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
        log(f"generate: weights from {step}")
    else:
        assert source.hf_dir is not None
        load_hf_weights(model, source.family, source.hf_dir, log=log)
        log(f"generate: weights from {source.hf_dir}")
    model.eval()
    return GenerationModel(model, source.family, tokenizer, source.hf_dir, step, dtype)


def shard_for_generation(model: nn.Module, log: Log) -> None:
    """``fully_shard`` every decoder layer and the root over all ranks (no-op with one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        for layer in layers:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    log(f"generate: weights sharded over {dist.get_world_size()} ranks (FSDP)")


def as_transformers(loaded: GenerationModel, log: Log) -> nn.Module:
    """The transformers model for ``infer_backend: huggingface``.

    The generic path's model is one already. A built-in family's trained weights are exported
    (``save_hf``, the `meshforge convert` writer) to a temporary folder that transformers loads,
    unless they came unchanged from a HF folder.
    """
    from transformers import AutoModelForCausalLM

    from meshforge.checkpoint.hf import save_hf
    from meshforge.models.spec import GENERIC

    if loaded.family.name == GENERIC:
        return loaded.model
    device = next(loaded.model.parameters()).device
    if loaded.step_dir is None and loaded.hf_dir is not None:
        folder = loaded.hf_dir
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=loaded.dtype)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            save_hf(loaded.model, loaded.family, tmp, tokenizer=None, collective=False)
            hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=loaded.dtype)
        log("generate: exported the checkpoint to transformers for infer_backend: huggingface")
    model: nn.Module = hf
    return model.to(device).eval()
