"""The passthrough keys of each optimizer and schedule type, declared once as typed dataclasses.

`optimizer:` and `lr_scheduler:` carry, besides their declared fields, keys that belong to the
chosen type (`warmup_ratio`, `lr_end`, `amsgrad`, ...). Each type declares them here as the fields
of one frozen dataclass: the field's type says how a YAML value is read (`int`, `float`, `bool`,
`bool | None` for true/false/null), `option()` adds the description, default, range and alias
names. `optim/specs.py` checks a section against these declarations (the messages of `config
validate`), and the builders receive an instance: `build_optimizer` (`optim/build.py`) an
`AdamWOptions` or `FusedAdamWOptions`, `lr_schedule` (`optim/schedulers.py`) the options of its
schedule type.

Light module: no torch import.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any

__all__ = [
    "OPTIMIZER_OPTIONS",
    "SCHEDULER_OPTIONS",
    "AdamWOptions",
    "CosineAnnealingLROptions",
    "CosineAnnealingWarmRestartsOptions",
    "CosineWithRestartsAndWarmUpLROptions",
    "ConstantWithCoolDownLROptions",
    "CosineWithWarmUpLROptions",
    "DecayToEndOptions",
    "FusedAdamWOptions",
    "MuonOptions",
    "PolynomialWithWarmUpLROptions",
    "SchedulerOptions",
    "WarmUpStableDecayLROptions",
    "WarmupOptions",
    "option",
]


def option(
    description: str,
    *,
    default: Any = None,
    required: bool = False,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    aliases: dict[str, str] | None = None,
) -> Any:
    """A passthrough key: a dataclass field whose metadata the checks in `optim/specs.py` read.

    Args:
        description: one line, shown in messages and docs.
        default: value when the key is absent (None = "not set").
        required: the type cannot be built without the key (the field then has no default).
        lo, hi: inclusive bounds (None = unbounded); `lo_open`/`hi_open` make them exclusive.
        aliases: other key names -> their description (`min_lr` for `lr_end`).
    """
    meta = {
        "description": description,
        "required": required,
        "lo": lo,
        "hi": hi,
        "lo_open": lo_open,
        "hi_open": hi_open,
        "aliases": aliases or {},
    }
    return field(default=MISSING if required else default, metadata=meta)


# ----------------------------------------------------------------------------- optimizers


@dataclass(frozen=True)
class FusedAdamWOptions:
    """`FusedAdamW` (MindSpeed's `optimizer: fused_adamw`): AdamW with the fused kernel forced."""

    amsgrad: bool = option("Use the AMSGrad variant of Adam.", default=False)


@dataclass(frozen=True)
class AdamWOptions(FusedAdamWOptions):
    """`AdamW`: torch's AdamW; the kernel is chosen by `optim/build.py` unless set here."""

    fused: bool | None = option(
        "Fused kernel; null lets meshforge choose (fused on CPU/CUDA, see optim/build.py)."
    )
    foreach: bool | None = option(
        "Multi-tensor (foreach) implementation; null lets meshforge choose (see optim/build.py)."
    )


# Keller Jordan's quintic Newton-Schulz coefficients (also torch.optim.Muon's defaults).
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)


@dataclass(frozen=True)
class MuonOptions(AdamWOptions):
    """`Muon`: Newton-Schulz-orthogonalised momentum for hidden matrices, AdamW for the rest.

    `amsgrad`, `fused` and `foreach` configure the AdamW part (embeddings, LM head, norms,
    biases, router), which also uses `optimizer.betas`, `eps` and the weight-decay rules.
    """

    momentum: float = option("Muon momentum coefficient.", default=0.95, lo=0.0, hi=1.0, hi_open=True)
    nesterov: bool = option("Nesterov momentum for the Muon update.", default=True)
    ns_steps: int = option("Newton-Schulz iterations per update.", default=5, lo=1, hi=100, hi_open=True)
    ns_coefficients: tuple[float, float, float] = option(
        "Newton-Schulz quintic coefficients [a, b, c].", default=NS_COEFFICIENTS
    )
    ns_eps: float = option(
        "Floor of the Frobenius norm the update is divided by before Newton-Schulz.",
        default=1e-7,
        lo=0.0,
        lo_open=True,
    )
    match_rms_adamw: bool = option(
        "Scale each matrix's lr by matched_adamw_rms * sqrt(max(rows, cols)) so that the update RMS "
        "matches AdamW's and AdamW's lr and weight decay carry over (Moonlight); false: "
        "sqrt(max(1, rows/cols)) (Keller Jordan's original).",
        default=True,
    )
    matched_adamw_rms: float = option(
        "Target update RMS of match_rms_adamw (Moonlight: 0.2).", default=0.2, lo=0.0, lo_open=True
    )
    ns_bfloat16: bool = option(
        "Run Newton-Schulz in bfloat16 as torch.optim.Muon does (fast on GPUs); false: in the "
        "parameter's dtype (float32 on the CPU).",
        default=False,
    )


OPTIMIZER_OPTIONS: dict[str, type] = {
    "AdamW": AdamWOptions,
    "FusedAdamW": FusedAdamWOptions,
    "Muon": MuonOptions,
}

# ----------------------------------------------------------------------------- schedules

_MIN_LR = {"min_lr": "Alias of lr_end (MindSpeed / Megatron name)."}


@dataclass(frozen=True)
class SchedulerOptions:
    """The options every schedule type has: none (the peak is `lr_scheduler.learning_rate`)."""


@dataclass(frozen=True)
class WarmupOptions(SchedulerOptions):
    """`ConstantWarmUpLR`, and the warm-up of every `*WarmUp*` schedule."""

    warmup_steps: int | None = option("Steps of linear warm-up; wins over warmup_ratio.", lo=0)
    warmup_ratio: float | None = option(
        "Warm-up length as a fraction of total_steps (int(total*ratio)); ignored when warmup_steps is set.",
        lo=0.0,
        hi=1.0,
    )
    warmup_lr_init: float = option("Learning rate at the first warm-up step.", default=0.0, lo=0.0)
    total_steps: int | None = option(
        "Horizon of the schedule; null or a value <= 0 (MindFormers writes -1) means training.steps."
    )


@dataclass(frozen=True)
class DecayToEndOptions(WarmupOptions):
    """`LinearWithWarmUpLR`, and the floor of every schedule that decays to `lr_end`."""

    lr_end: float = option("Final (floor) learning rate of the decay.", default=0.0, lo=0.0, aliases=_MIN_LR)


@dataclass(frozen=True)
class CosineWithWarmUpLROptions(DecayToEndOptions):
    num_cycles: float = option(
        "Number of cosine waves over the decay (0.5 = one half-cosine from peak to lr_end).",
        default=0.5,
        lo=0.0,
        lo_open=True,
    )
    decay_steps: int | None = option(
        "Step at which the cosine reaches lr_end and stays there (default: total_steps).", lo=1
    )
    decay_ratio: float | None = option(
        "decay_steps as a fraction of total_steps; ignored when decay_steps is set.",
        lo=0.0,
        lo_open=True,
        hi=1.0,
    )


@dataclass(frozen=True)
class WarmUpStableDecayLROptions(DecayToEndOptions):
    lr_end: float = option("Final (floor) learning rate of the decay.", default=1e-7, lo=0.0, aliases=_MIN_LR)
    decay_start_steps: int | None = option(
        "Step at which the linear decay to lr_end starts (end of the stable phase).", lo=0
    )
    decay_start_ratio: float | None = option(
        "decay_start_steps as a fraction of total_steps; ignored when decay_start_steps is set.",
        lo=0.0,
        hi=1.0,
    )
    decay_ratio: float | None = option(
        "Length of the decay phase as a fraction of total_steps (decay starts at "
        "total - int(total*ratio)); ignored when decay_start_steps is set.",
        lo=0.0,
        hi=1.0,
    )


@dataclass(frozen=True)
class PolynomialWithWarmUpLROptions(DecayToEndOptions):
    lr_end: float = option("Final (floor) learning rate of the decay.", default=1e-7, lo=0.0, aliases=_MIN_LR)
    power: float = option(
        "Exponent of the polynomial decay (1.0 = linear).", default=1.0, lo=0.0, lo_open=True
    )
    decay_steps: int | None = option(
        "Length of the decay after the warm-up (default: total_steps - warm-up); lr_end afterwards.",
        lo=1,
    )


@dataclass(frozen=True)
class CosineWithRestartsAndWarmUpLROptions(DecayToEndOptions):
    num_cycles: float = option(
        "Number of restarts (hard restarts to the peak) between the warm-up and decay_steps.",
        default=1.0,
        lo=0.0,
        lo_open=True,
    )
    decay_steps: int | None = option(
        "Step at which the schedule ends at lr_end (default: total_steps).", lo=1
    )


@dataclass(frozen=True)
class ConstantWithCoolDownLROptions(WarmupOptions):
    """MindFormers' piecewise schedule (DeepSeek-V3): warm-up, hold, cosine cool-down, two floors.

    Names and defaults are MindFormers'; `decay_steps` defaults to total_steps, as there.
    """

    keep_steps: int = option("Steps held at learning_rate after the warm-up.", default=0, lo=0)
    decay_steps: int | None = option(
        "Length of the cosine cool-down after the hold (default: total_steps); wins over decay_ratio.",
        lo=1,
    )
    decay_ratio: float | None = option(
        "decay_steps as a fraction of total_steps (int(total*ratio)); ignored when decay_steps is set.",
        lo=0.0,
        hi=1.0,
    )
    num_cycles: float = option(
        "Number of cosine waves over the cool-down (0.5 = one half-cosine from the peak to lr_end1).",
        default=0.5,
        lo=0.0,
        lo_open=True,
    )
    lr_end1: float = option("Learning rate at the end of the cool-down.", default=0.0, lo=0.0)
    final_steps: int = option("Steps held at lr_end1 after the cool-down.", default=0, lo=0)
    lr_end2: float | None = option("Learning rate after the final_steps (null: lr_end1).", lo=0.0)


_ETA_MIN = "Lowest learning rate of each cosine."


@dataclass(frozen=True)
class CosineAnnealingLROptions(SchedulerOptions):
    t_max: int = option("Steps of one half-cosine from learning_rate to eta_min.", lo=1, required=True)
    eta_min: float = option(_ETA_MIN, default=0.0, lo=0.0)


@dataclass(frozen=True)
class CosineAnnealingWarmRestartsOptions(SchedulerOptions):
    t_0: int = option("Steps until the first restart.", lo=1, required=True)
    t_mult: int = option("Factor by which each period grows after a restart.", default=1, lo=1)
    eta_min: float = option(_ETA_MIN, default=0.0, lo=0.0)


SCHEDULER_OPTIONS: dict[str, type[SchedulerOptions]] = {
    "ConstantWarmUpLR": WarmupOptions,
    "ConstantWithCoolDownLR": ConstantWithCoolDownLROptions,
    "LinearWithWarmUpLR": DecayToEndOptions,
    "CosineWithWarmUpLR": CosineWithWarmUpLROptions,
    "WarmUpStableDecayLR": WarmUpStableDecayLROptions,
    "PolynomialWithWarmUpLR": PolynomialWithWarmUpLROptions,
    "CosineWithRestartsAndWarmUpLR": CosineWithRestartsAndWarmUpLROptions,
    "CosineAnnealingLR": CosineAnnealingLROptions,
    "CosineAnnealingWarmRestarts": CosineAnnealingWarmRestartsOptions,
}
