"""The Hugging Face export at the end of a run (`checkpoint.save_hf_weights`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch.nn as nn

from meshforge.utils import distributed as dist_utils

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.models.config import LoraConfig
    from meshforge.models.registry import FamilySpec


def export_hf_from_memory(
    model: nn.Module,
    family: FamilySpec,
    out_dir: Path,
    *,
    tokenizer: PreTrainedTokenizerBase | None,
    log: Callable[[str], None],
) -> Path:
    """Write the current weights, config and tokenizer as a HF folder (collective: FSDP gathers)."""
    from meshforge.checkpoint.hf import save_hf

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
    from meshforge.checkpoint.convert import dcp_to_hf

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
    section: LoraConfig,
    base_model: str | None,
    merged: bool,
    tokenizer: PreTrainedTokenizerBase | None,
    log: Callable[[str], None],
) -> Path:
    """A LoRA run's exports (collective): the PEFT adapter folder `{output_dir}/adapter`, and with
    `checkpoint.save_hf_weights` the merged Hugging Face folder `{output_dir}/hf`."""
    from meshforge.lora.peft_io import save_merged_hf, save_peft_adapter
    from meshforge.lora.settings import lora_settings

    adapter = save_peft_adapter(
        model, family, output_dir / "adapter", settings=lora_settings(section), base_model=base_model or ""
    )
    log(f"lora: wrote the PEFT adapter folder {adapter}")
    if merged:
        out = save_merged_hf(model, family, output_dir / "hf", tokenizer=tokenizer)
        log(
            f"checkpoint: exported Hugging Face weights with the adapters merged to {out} (checkpoint.save_hf_weights)"
        )
        return out
    return adapter
