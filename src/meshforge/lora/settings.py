"""`lora_config` section -> `LoraSettings` (the one place the config class meets the LoRA code)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshforge.config.layer_spec import expand_layers
from meshforge.lora.apply import LoraSettings

if TYPE_CHECKING:
    from meshforge.models.config import LoraConfig


def lora_settings(section: LoraConfig) -> LoraSettings:
    """The adapter settings of a `lora_config` section (`target_modules`, `exclude_layers`,
    `lora_rank`, `lora_alpha`, `lora_dropout`, `lora_a_std`, `lora_b_std`)."""
    target = section.target_modules
    return LoraSettings(
        target_modules=target if isinstance(target, str) else tuple(target),
        exclude_layers=frozenset(expand_layers(section.exclude_layers)),
        rank=section.lora_rank,
        alpha=section.lora_alpha,
        dropout=section.lora_dropout,
        a_std=section.lora_a_std,
        b_std=section.lora_b_std,
    )
