"""Hugging Face exports of a reward model (`training.stage: rm`): transformers'
`AutoModelForSequenceClassification` folder.

The base model is written by the causal LM exporter (`save_hf`, or `save_merged_hf` with the
LoRA adapters merged) with the value head taken off; the folder is then turned into the
sequence-classification layout: `lm_head.weight` dropped (a reward model never runs it),
`score.weight` added, and `config.json` given the family's `*ForSequenceClassification`
architecture, `num_labels: 1` and the tokenizer's `pad_token_id` (transformers scores a row at
its last non-pad token, which is where meshforge reads the reward).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshforge.checkpoint.hf import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, save_hf
from meshforge.train.reward_head import HEAD_WEIGHT, attach_value_head, value_head, value_head_detached

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import ValueType

    from meshforge.checkpoint.source import ModelSource
    from meshforge.config.root import TrainConfig
    from meshforge.models.registry import FamilySpec

LM_HEAD = "lm_head.weight"


def save_reward_hf(
    model: nn.Module,
    family: FamilySpec,
    out_dir: str | Path,
    *,
    tokenizer: Any = None,
    merge_adapters: bool = False,
    shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    collective: bool = True,
) -> Path:
    """Write a reward model as a sequence-classification folder (collective like `save_hf`)."""
    from meshforge.lora.peft_io import merged_weights

    weight = value_head(model).weight.detach()
    score = (weight.full_tensor() if isinstance(weight, DTensor) else weight).cpu()
    with value_head_detached(model):
        with merged_weights(model) if merge_adapters else contextlib.nullcontext():
            out = save_hf(
                model,
                family,
                out_dir,
                tokenizer=tokenizer,
                shard_size=shard_size,
                dtype=dtype,
                collective=collective,
            )
    if (out / CONFIG_FILE).is_file() and (not collective or _is_main()):
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        as_sequence_classification(out, score.to(dtype) if dtype is not None else score, pad_token_id=pad)
    if collective:
        from meshforge.utils import distributed as dist_utils

        dist_utils.barrier()
    return out


def _is_main() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def as_sequence_classification(folder: Path, score: torch.Tensor, *, pad_token_id: int | None) -> None:
    """Turn a causal LM folder written by `save_hf` into the `*ForSequenceClassification` layout."""
    from safetensors.torch import load_file

    from meshforge.checkpoint.safetensors_file import write_safetensors

    index_file = folder / INDEX_FILE
    index: dict[str, Any] | None = json.loads(index_file.read_text()) if index_file.is_file() else None
    weight_map: dict[str, str] = index["weight_map"] if index is not None else {}
    files = sorted(set(weight_map.values())) if index is not None else [SINGLE_FILE]
    # The head goes into the file that held lm_head (else the last one); lm_head leaves the folder.
    target = weight_map.get(LM_HEAD, files[-1]) if index is not None else SINGLE_FILE
    tensors = load_file(str(folder / target))
    tensors.pop(LM_HEAD, None)
    tensors[HEAD_WEIGHT] = score.contiguous()
    write_safetensors(tensors, folder / target, metadata={"format": "pt"})
    if index is not None:
        weight_map.pop(LM_HEAD, None)
        weight_map[HEAD_WEIGHT] = target
        index["weight_map"] = dict(sorted(weight_map.items()))
        index_file.write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((folder / CONFIG_FILE).read_text())
    archs = [
        str(a).replace("ForCausalLM", "ForSequenceClassification") for a in config.get("architectures", [])
    ]
    config["architectures"] = archs
    config["num_labels"] = 1
    config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    if pad_token_id is not None:
        config["pad_token_id"] = int(pad_token_id)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_reward_step(
    cfg: TrainConfig,
    source: ModelSource,
    options: dict[str, object],
    step: Path,
    dtype: torch.dtype,
    log: Callable[[str], None],
) -> nn.Module:
    """A reward model's DCP step on the CPU, whole: base weights, adapters (LoRA) and the value head.

    Run inside a one-process group (`one_rank_group`).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from meshforge.checkpoint.dcp_reader import load_dcp
    from meshforge.models.materialize import reset_buffers

    if cfg.lora_config is not None:
        from meshforge.checkpoint.manager import read_trainer_state
        from meshforge.lora.offline import build_adapted, load_lora_step, lora_record
        from meshforge.lora.settings import lora_settings

        record = lora_record(read_trainer_state(step))
        if record is None:
            raise ValueError(
                f"convert: {step} holds a full model but its config has lora_config; remove it from --config"
            )
        settings = lora_settings(cfg.lora_config)
        cpu = torch.device("cpu")
        model = build_adapted(source.family, options, settings, dtype=dtype, device=cpu)
        load_lora_step(
            model, source.family, step, record, settings=settings, seed=cfg.training.seed, device=cpu, log=log
        )
        attach_value_head(model)
        state: dict[str, dict[str, ValueType]] = {"model": {HEAD_WEIGHT: value_head(model).weight.detach()}}
    else:
        from meshforge.checkpoint.offline import build_on_cpu

        model = build_on_cpu(source.family, options, dtype)
        attach_value_head(model)
        state = {"model": get_model_state_dict(model)}
    load_dcp(state, step, no_dist=True)
    if cfg.lora_config is None:
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
    reset_buffers(model)
    return model


def reward_step_to_hf(
    cfg: TrainConfig,
    source: ModelSource,
    options: dict[str, object],
    step: Path,
    out: Path,
    *,
    tokenizer: Any,
    params_dtype: torch.dtype,
    shard_size: int | str,
    dtype: torch.dtype | None,
    log: Callable[[str], None],
) -> Path:
    """`meshforge convert --to hf` of a reward model's step: the sequence-classification folder."""
    from meshforge.checkpoint.offline import one_rank_group

    with one_rank_group():
        model = load_reward_step(cfg, source, options, step, params_dtype, log)
        save_reward_hf(
            model,
            source.family,
            out,
            tokenizer=tokenizer,
            merge_adapters=cfg.lora_config is not None,
            shard_size=shard_size,
            dtype=dtype,
            collective=False,
        )
    log(
        f"convert: wrote {out} (Hugging Face {source.family.name} reward model, AutoModelForSequenceClassification) from {step}"
    )
    return out
