"""Build the step of a `training.stage: rm` run (`train/reward.py`) from the built model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from meshforge.models.common.kernels import supports_hidden_output
from meshforge.train.reward import RewardStep
from meshforge.train.reward_head import value_head

if TYPE_CHECKING:
    from meshforge.config.root import TrainConfig
    from meshforge.train.run import ModelParts, RunEnv


def build_reward(cfg: TrainConfig, env: RunEnv, parts: ModelParts) -> RewardStep | None:
    """The reward-model step of a `stage: rm` run (None for other stages).

    Raises:
        ValueError: a model part the step does not compute (MTP) or a model without final
            hidden states, named by key.
    """
    if cfg.training.stage != "rm":
        return None
    if parts.mtp_coef:
        raise ValueError("not supported yet: multi-token prediction (MTP) with training.stage: rm")
    if not supports_hidden_output(parts.module):
        raise ValueError(
            "training.stage: rm: the model gives no final hidden states (forward(..., return_hidden=True)); "
            "use a meshforge model family (model.model_type)"
        )
    kernels = cfg.kernels
    loss_keys = [
        key
        for key, on in (
            ("kernels.chunk_loss_size", kernels.chunk_loss_size is not None),
            ("kernels.fused_linear_cross_entropy", kernels.fused_linear_cross_entropy is True),
            ("parallelism.enable_loss_parallel", cfg.parallelism.enable_loss_parallel and env.dims.tp > 1),
        )
        if on
    ]
    if loss_keys:
        env.log(
            f"warning: {', '.join(loss_keys)}: no effect with training.stage: rm (the LM head never runs; "
            "the value head reads one hidden state per sequence)"
        )
    head = value_head(parts.module)
    trains = "trained with the adapters" if parts.lora is not None else "trained"
    env.log(
        f"reward model: value head score [{head.in_features} -> 1] on the last token of each sequence, {trains}"
    )
    return RewardStep(
        compute_dtype=parts.compute_dtype,
        autocast=parts.compute_dtype != torch.float32 and not parts.fsdp,
        device=env.device,
        aux_coef=parts.aux_coef if parts.aux_loss_enabled else 0.0,
    )
