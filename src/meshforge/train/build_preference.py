"""Build the preference step of a `training.stage: dpo` run (`train/preference.py`) and its reference model."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from meshforge.loss.preference import METRIC_KEYS, PreferenceLoss
from meshforge.train.preference import ORPO_KEYS, PreferenceStep
from meshforge.train.reference_table import ReferenceTable

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from meshforge.config.root import TrainConfig
    from meshforge.train.preference_cp import CPPairs
    from meshforge.train.run import ModelParts, RunEnv


def build_preference(
    cfg: TrainConfig, env: RunEnv, parts: ModelParts, tokenizer: PreTrainedTokenizerBase
) -> PreferenceStep | None:
    """The preference step of a `stage: dpo` run (None for other stages).

    Raises:
        ValueError: a model part the step does not compute (router aux loss, MTP), named by key.
    """
    training = cfg.training
    if training.stage != "dpo":
        return None
    if parts.mtp_coef:
        raise ValueError("not supported yet: multi-token prediction (MTP) with training.stage: dpo")
    loss = PreferenceLoss(
        loss_type=training.pref_loss,
        beta=training.pref_beta,
        label_smoothing=training.dpo_label_smoothing,
        simpo_gamma=training.simpo_gamma,
        ftx=training.pref_ftx,
    )
    lora = parts.lora is not None
    reference = None
    precompute = loss.needs_reference and training.pref_ref_logps == "precompute"
    # Under PP the frozen copy runs as a pipeline of its own (`train/preference_pipeline.py`).
    if loss.needs_reference and not lora and env.dims.pp == 1:
        if not precompute:  # else built, used and freed by the table pass (train/reference_table.py)
            reference = build_reference(cfg, env, tokenizer)
        if env.load_path:
            # The copy comes from the model source; a checkpoint loads into the policy only.
            env.log(
                "warning: training.stage: dpo: the reference model is the model source (model_name_or_path "
                "or the seeded init), not checkpoint.load_path: exact when resuming this run; to start DPO "
                "from another run's weights, export them to an HF folder and name it in model_name_or_path"
            )
    kind = (
        "none (reference-free loss)"
        if not loss.needs_reference
        else "precomputed log-probabilities (train/reference_table.py)"
        if precompute
        else "the policy with LoRA adapters disabled"
        if lora
        else "a frozen copy of the model, sharded as the policy"
    )
    env.log(f"preference: {loss.loss_type} loss, beta {loss.beta:g}; reference model: {kind}")
    return PreferenceStep(
        loss=loss,
        lora=lora,
        reference=reference,
        chunk_size=parts.lm_loss.chunk_size if parts.lm_loss.needs_hidden else None,
        compute_dtype=parts.compute_dtype,
        autocast=parts.compute_dtype != torch.float32 and not parts.fsdp,
        device=env.device,
        keys=METRIC_KEYS + (ORPO_KEYS if loss.loss_type == "orpo" else ()),
        aux_coef=parts.aux_coef if parts.aux_loss_enabled else 0.0,
        table=ReferenceTable() if precompute else None,
        cp=_cp_pairs(cfg, env),
    )


def _cp_pairs(cfg: TrainConfig, env: RunEnv) -> CPPairs | None:
    """The whole-row side of the pair sums under context parallelism (`train/preference_cp.py`)."""
    if env.dims.cp == 1:
        return None
    from meshforge.train.preference_cp import CPPairs

    return CPPairs(env.mesh.view("cp"), cfg.parallelism.cp_method())


def build_reference(cfg: TrainConfig, env: RunEnv, tokenizer: PreTrainedTokenizerBase) -> nn.Module:
    """The full-fine-tuning reference: the model built again exactly as the policy, frozen.

    `build_model` reads the same source (HF folder or seeded per-parameter init) and applies the
    same parallelisation, so the copy starts equal to the policy and is sharded like it. Its log
    lines are the policy's again and are not repeated.
    """
    from meshforge.train.build_model import build_model

    quiet = dataclasses.replace(env, log=lambda _line: None)
    reference = build_model(cfg, quiet, tokenizer).module
    reference.requires_grad_(False)
    return reference.eval()
