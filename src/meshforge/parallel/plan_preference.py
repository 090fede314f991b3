"""The reference model of `training.stage: dpo` in the layout plan: what each choice costs a rank.

The choices (`train/build_preference.py`, docs/preference.md):
* none: orpo and simpo compare the answers without a reference;
* LoRA: the policy with its adapters disabled: no weights of its own, one more forward without
  gradients per micro-batch;
* a frozen copy (full fine-tuning, `pref_ref_logps: model`): a second set of weights, sharded like
  the policy's (FSDP, TP, EP, pipeline stage), held for the whole run: added to the predicted peak;
* `pref_ref_logps: precompute`: a table of two float32 sums per pair on the device; the copy (or
  the adapters-off policy) runs once over the data before step 1, when no gradient or optimizer
  state exists yet, and the copy is freed before training: nothing added to the training peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshforge.config.root import TrainConfig

_GIB = 1024**3
BYTES_PER_PAIR = 8  # the reference table holds two float32 sums a pair (train/reference_table.py)
_ROWS = "pair rows hold 2 x cutoff_len tokens (the activation estimate counts cutoff_len)"


@dataclass(frozen=True)
class ReferenceCost:
    """The reference choice of a run and the weight bytes a frozen copy puts on each pipeline rank.

    Attributes:
        choice: none, adapters, copy or precompute (empty: not a dpo run).
        copy_bytes: per pipeline rank, the bytes of a frozen copy sharded as the policy.
        lora: the run trains LoRA adapters (the reference is then the adapters-off policy).
    """

    choice: str
    copy_bytes: list[float]
    lora: bool

    @classmethod
    def of(cls, cfg: TrainConfig, copy_bytes: list[float], *, lora: bool) -> ReferenceCost:
        training = cfg.training
        if training.stage != "dpo":
            choice = ""
        elif training.pref_loss in ("orpo", "simpo"):
            choice = "none"
        elif training.pref_ref_logps == "precompute":
            choice = "precompute"
        else:
            choice = "adapters" if lora else "copy"
        return cls(choice, copy_bytes, lora)

    @property
    def device_bytes(self) -> list[float]:
        """What the reference adds to each pipeline rank's training peak (only a frozen copy)."""
        return [b if self.choice == "copy" else 0.0 for b in self.copy_bytes]

    def lines(self, pref_loss: str) -> list[str]:
        """The plan's `dpo reference model:` line (none outside dpo)."""
        worst = max(self.copy_bytes, default=0.0) / _GIB
        if not self.choice:
            return []
        if self.choice == "none":
            return [f"dpo reference model: none ({pref_loss} is reference-free); {_ROWS}"]
        if self.choice == "adapters":
            return [
                "dpo reference model: the policy with its LoRA adapters disabled: no extra weights, one more "
                f"forward without gradients per micro-batch; {_ROWS}"
            ]
        if self.choice == "copy":
            return [
                f"dpo reference model: a frozen copy sharded as the policy: +{worst:.2f} GiB of weights per "
                "rank (no gradients or AdamW; included in the predicted peak), one more forward without "
                f"gradients per micro-batch; {_ROWS}"
            ]
        source = (
            "the policy with its LoRA adapters disabled"
            if self.lora
            else f"a frozen copy sharded as the policy (+{worst:.2f} GiB per rank during that pass only, freed after it)"
        )
        return [
            f"dpo reference model: precomputed (training.pref_ref_logps: precompute): a table of "
            f"{BYTES_PER_PAIR} bytes a pair on the device ({100_000 * BYTES_PER_PAIR / 1e6:.1f} MB per 100k "
            "pairs), no reference weights and no reference forward in training; one pass over the train "
            f"and validation pairs before step 1 with {source}, saved and reused; {_ROWS}"
        ]
