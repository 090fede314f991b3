"""What every loader builder needs besides the `train_dataset` section (LIGHT: no torch import).

One `LoaderContext` is made per run and handed to both `build_train_loader` and
`build_eval_loader`; builders that run one data pipeline for both loaders (SFT) keep its result in
`shared`, so the pipeline runs once per context, not once per call.

`build_eval_loaders` returns its loaders by name: one validation set (the usual case) under
`MIXED_EVAL`, or one per evaluation dataset (SFT `eval_on_each_dataset`) under its dataset name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The name of the one (mixed) validation set among the named evaluation loaders: it has no
# per-dataset metrics of its own, only `eval_loss` / `eval_tokens`.
MIXED_EVAL = ""


@dataclass(frozen=True)
class LoaderContext:
    """This rank's place in the run and the run's sizes, as the loaders see them.

    Attributes:
        tokenizer: the run's Hugging Face tokenizer (None only for data that needs none, e.g.
            Megatron data with `eod` set).
        local_batch_size: samples per micro-batch on this rank (`training.local_batch_size`); the
            rows per evaluation batch for `build_eval_loader`.
        dp_rank, dp_size: position on the data-parallel ("batch") mesh axis.
        seed: `training.seed`; the sample order depends only on it and the epoch.
        global_batch_size: samples per optimizer step over all ranks; epochs are rounded to whole
            steps with it, so a step never mixes epochs (see `StatefulLoader`).
        total_steps: optimizer steps of the run; loaders that size their data by it (Megatron:
            train samples = steps x global batch) use it.
        epochs: `training.epochs`: size the run by the data instead; the train loader's
            `total_steps` then holds the resulting number of optimizer steps.
        log: receives the data summary and notes (pass the rank-0 logger).
        shared: results a builder keeps for the other loader of the same run (the SFT pipeline).
        pairwise: preference training (`training.stage: dpo`): the SFT loader reads ranking
            datasets into pair rows (`data/sft/pairwise.py`).
    """

    tokenizer: PreTrainedTokenizerBase | None
    local_batch_size: int
    dp_rank: int
    dp_size: int
    seed: int
    global_batch_size: int | None = None
    total_steps: int | None = None
    epochs: float | None = None
    log: Callable[[str], None] | None = None
    shared: dict[str, object] = field(default_factory=dict, compare=False, repr=False)
    pairwise: bool = False

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: `global_batch_size`, else one round of all ranks."""
        return self.global_batch_size or self.dp_size * self.local_batch_size

    def say(self, text: str) -> None:
        """Send one line to `log`, when there is one."""
        if self.log is not None:
            self.log(text)
