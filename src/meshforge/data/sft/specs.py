"""Options of `SFTDataLoader` (LIGHT: pydantic only).

The SFT data fields live directly under `train_dataset` (MindSpeed DataArguments names), so the
loader takes no options of its own under `train_dataset.dataloader`; any key there is a mistake.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# Built chat templates (`train_dataset.template`; null = the tokenizer's own chat_template) and tool
# formats, listed here so the config can check names without importing the templates module.
TEMPLATE_NAMES = ("qwen3", "qwen3_nothink", "chatml", "llama3", "empty", "gpt", "gpt_oss")
TOOL_FORMATS = ("qwen",)


class SFTDataLoaderOptions(BaseModel):
    """No own options: set template, dataset, cutoff_len, packing, ... under `train_dataset`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
