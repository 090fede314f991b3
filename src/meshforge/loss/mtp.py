"""The trainer's multi-token-prediction (MTP) loss: which models train it, and its value per micro-batch.

A model with MTP depths (DeepSeek-V3's ``num_nextn_predict_layers``) exposes ``num_mtp_layers``,
``set_mtp(active)`` and ``mtp_outputs()`` (per depth, the logits of the last training forward).
With ``training.mtp_loss_scaling_factor`` > 0 the objective of each micro-batch adds
``factor * mtp_cross_entropy_sum / normalizer`` (the main loss's global valid-token count), and
the step logs the unscaled sum of those terms as ``mtp_loss``. A factor changed from its default
on a model without MTP depths is an error before any weight is read.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import torch

from meshforge.loss.cross_entropy import mtp_cross_entropy_sum

if TYPE_CHECKING:
    from torch import nn

    from meshforge.loss.lm import LMLoss

# training.mtp_loss_scaling_factor's default (MindSpeed's): leaving it there is no request for MTP.
DEFAULT_MTP_FACTOR = 0.3


@runtime_checkable
class MTPModel(Protocol):
    """What the trainer needs of a model with MTP depths."""

    @property
    def num_mtp_layers(self) -> int: ...
    def set_mtp(self, active: bool) -> None: ...
    def mtp_outputs(self) -> list[torch.Tensor]: ...


def mtp_factor(model: nn.Module, factor: float, *, family: str, context_parallel: int = 1) -> float:
    """The factor the trainer applies (0: no MTP), after switching the model's MTP depths on or off.

    Raises:
        ValueError: ``training.mtp_loss_scaling_factor`` changed on a model without MTP depths,
            or MTP under context parallelism (not built).
    """
    depths = model.num_mtp_layers if isinstance(model, MTPModel) else 0
    if depths == 0:
        if factor != DEFAULT_MTP_FACTOR:
            where = (
                "model.num_nextn_predict_layers is 0"
                if isinstance(model, MTPModel)
                else f"the {family} family has no multi-token-prediction layers (deepseek_v3 has)"
            )
            raise ValueError(
                f"training.mtp_loss_scaling_factor: {factor} asks for the multi-token-prediction loss, but "
                f"{where}; leave it at {DEFAULT_MTP_FACTOR} or use a model with MTP layers"
            )
        return 0.0
    assert isinstance(model, MTPModel)
    if factor > 0 and context_parallel > 1:
        # Depth k reads token i + k, which for the last k positions of a CP rank's slice lives
        # on another rank.
        raise ValueError(
            "not supported yet: multi-token prediction (model.num_nextn_predict_layers > 0) with "
            "parallelism.context_parallel > 1; set training.mtp_loss_scaling_factor: 0 to train without it"
        )
    model.set_mtp(factor > 0)
    return float(factor)


def mtp_loss_sum(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    lm_loss: LMLoss,
    loss_context: contextlib.AbstractContextManager[None],
) -> torch.Tensor:
    """The MTP cross-entropy sum of the forward that just ran on ``batch`` (mean over depths)."""
    outputs = cast(MTPModel, model).mtp_outputs()
    weight = None
    if lm_loss.needs_hidden:
        weight = cast("nn.Linear", model.get_submodule("lm_head")).weight
    with loss_context:
        return mtp_cross_entropy_sum(
            outputs, batch["labels"], batch.get("segment_ids"), head_weight=weight, loss_fn=lm_loss
        )


__all__ = ["DEFAULT_MTP_FACTOR", "MTPModel", "mtp_factor", "mtp_loss_sum"]
