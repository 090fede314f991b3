"""`optimizer:` and `lr_scheduler:` sections (light; both keep undeclared keys for their type).

The declared fields are the ones every optimizer or scheduler shares; anything else (`warmup_steps`,
`min_lr`, Muon options, ...) stays in `model_extra` and is checked by `meshforge.optim.specs` for
the chosen type, so a misspelt option is reported instead of ignored.
"""

from __future__ import annotations

from pydantic import field_validator

from meshforge.config.base import Bool, Float, NonNegFloat, PassthroughSection, PosFloat, describe


class OptimizerConfig(PassthroughSection):
    """Optimizer type and the hyper-parameters shared by AdamW-style optimizers."""

    type: str = describe(
        "AdamW", "Optimizer type: AdamW, FusedAdamW or Muon (Muon for hidden matrices, AdamW for the rest)."
    )
    betas: list[Float] = describe([0.9, 0.95], "Adam moment coefficients [beta1, beta2], each in [0, 1).")
    eps: PosFloat = describe(1e-8, "Adam denominator epsilon.")
    weight_decay: NonNegFloat = describe(0.01, "Decoupled weight decay.")
    weight_decay_include: list[str] | None = describe(
        None, "Parameter-name patterns that always get weight decay (substring, or glob with * ? {})."
    )
    weight_decay_exclude: list[str] | None = describe(
        None,
        "Parameter-name patterns that never get weight decay (norms and biases are excluded by default).",
    )
    accumulate_allreduce_grads_in_fp32: Bool = describe(
        True, "Accumulate and reduce gradients of low-precision parameters in fp32."
    )

    @field_validator("betas")
    @classmethod
    def _betas(cls, value: list[float]) -> list[float]:
        if len(value) != 2:
            raise ValueError(f"must be two values [beta1, beta2], got {value}")
        for i, beta in enumerate(value):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {beta}")
        return value

    @field_validator("weight_decay_include", "weight_decay_exclude")
    @classmethod
    def _patterns(cls, value: list[str] | None) -> list[str] | None:
        for i, item in enumerate(value or []):
            if not item.strip():
                raise ValueError(f"item [{i}] is blank; give a parameter-name pattern")
        return value


class LrSchedulerConfig(PassthroughSection):
    """Learning-rate schedule: type and base rate; warmup/decay options pass through to the type."""

    type: str | None = describe(
        None, "Scheduler type: ConstantWarmUpLR, CosineWithWarmUpLR, LinearWithWarmUpLR, WarmUpStableDecayLR."
    )
    learning_rate: NonNegFloat = describe(1e-5, "Base (peak) learning rate.")
