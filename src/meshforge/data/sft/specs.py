"""Options of `SFTDataLoader` (LIGHT: pydantic only).

The SFT data fields live directly under `train_dataset` (MindSpeed DataArguments names), so the
loader takes no options of its own under `train_dataset.dataloader`; any key there is a mistake.
Consumed by `meshforge.data.sft.loader.build_sft_loader` (and its eval twin).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ConfigDict

from meshforge.data.config import TEMPLATE_NAMES, TOOL_FORMATS
from meshforge.data.options import LoaderOptions

if TYPE_CHECKING:
    from meshforge.data.config import TrainDatasetConfig

__all__ = ["TEMPLATE_NAMES", "TOOL_FORMATS", "SFTDataLoaderOptions", "SFTSequenceOptions"]


class SFTSequenceOptions(LoaderOptions):
    """The sequence length of `SFTDataLoader`: `train_dataset.cutoff_len`, whatever the options hold."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    def sequence(self, data: TrainDatasetConfig) -> tuple[int, str]:
        # A packed (or padded) row is cutoff_len tokens long.
        return data.cutoff_len, "train_dataset.cutoff_len"


class SFTDataLoaderOptions(SFTSequenceOptions):
    """No own options: set template, dataset, cutoff_len, packing, ... under `train_dataset`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
