"""`training:` section: run length, batch sizes, clipping, seed, output folder (light: no torch).

Lives beside `trainer.py`, which consumes it. Holds the MindFormers TrainingConfig fields with the
code's `__post_init__` rules, plus native homes for MindSpeed TrainingArguments (`output_dir`,
`gradient_accumulation_steps`, `epochs`, `stage`, loss coefficients, the preference-loss fields, logging switches).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from meshforge.config.base import (
    AtLeastOne,
    Bool,
    Float,
    Int,
    NonNegFloat,
    PosFloat,
    PosInt,
    StrictSection,
    describe,
    rule_error,
)


class TrainingConfig(StrictSection):
    """How long and with what batch the run trains."""

    steps: AtLeastOne = describe(1000, "Total number of optimizer steps of the run (also when resuming).")
    local_batch_size: PosInt = describe(1, "Micro-batch size per data-parallel rank.")
    global_batch_size: PosInt | None = describe(
        None,
        "Samples per optimizer step; accumulation steps = global_batch_size // (dp * local_batch_size). "
        "None: dp x local_batch_size (x gradient_accumulation_steps), so a config scales with the world size.",
    )
    max_norm: PosFloat = describe(1.0, "Clip the global gradient norm to this value every step.")
    seed: Int = describe(42, "Random seed for initialisation, data order and dropout.")
    deterministic: Bool = describe(False, "Use deterministic algorithms (bitwise-reproducible, slower).")
    rampup_batch_size: list[Any] | None = describe(
        None, "Batch-size ramp-up [start > 0, increment > 0, ramp samples >= 0] (Megatron); data/rampup.py."
    )
    output_dir: str = describe(
        "./output", "Run folder: resolved config, metrics.jsonl, default checkpoint folder."
    )
    overwrite_output_dir: Bool = describe(
        False,
        "Start over in an output_dir that holds an earlier run, removing its checkpoints and metrics "
        "(HF Trainer key); without it such a folder is refused unless checkpoint.load_path resumes it.",
    )
    gradient_accumulation_steps: PosInt | None = describe(
        None, "Micro-batches per step; exclusive with an explicit global_batch_size (MindSpeed key)."
    )
    epochs: PosFloat | None = describe(
        None, "Train for this many epochs instead of `steps` (MindSpeed num_train_epochs)."
    )
    eval_interval: PosInt | None = describe(None, "Evaluate every this many steps (needs an eval dataset).")
    eval_iters: PosInt | None = describe(
        None, "Validation batches per evaluation on each rank (Megatron eval_iters); None = the whole split."
    )
    log_interval: PosInt = describe(1, "Log every this many steps (MindSpeed logging_steps).")
    rerun_mode: Literal["validate_results", "disabled"] = describe(
        "validate_results",
        "A skipped step (non-finite, or above the health threshold) is computed again from the same state "
        "and data: the same result is a real divergence, another one a transient fault (logged with the "
        "rank; the rerun's result stands). Megatron-LM's --rerun-mode.",
    )
    step_timeout_s: NonNegFloat | None = describe(
        None,
        "A step running longer writes every rank's stack and collective to {output_dir}/hang-rank{R}.txt, "
        "names the ranks that had not arrived and exits 3; null: max(10 min, 20x the median step), "
        "20 min over the first 3 steps; 0: off.",
    )
    stage: Literal["pt", "sft", "dpo", "rm"] = describe(
        "pt",
        "Training stage: pretraining (pt), supervised fine-tuning (sft), preference optimisation on "
        "pairwise data (dpo) or a reward model trained on the same pairs (rm; see docs/preference.md).",
    )
    pref_beta: PosFloat = describe(
        0.1, "Preference loss beta: the weight of the log-ratio (DPO's beta, IPO's tau; LLaMA-Factory key)."
    )
    pref_loss: Literal["sigmoid", "hinge", "ipo", "orpo", "simpo"] = describe(
        "sigmoid",
        "Preference loss: sigmoid (DPO), hinge, ipo, orpo or simpo (the last two without a reference model).",
    )
    pref_ftx: NonNegFloat = describe(
        0.0, "Weight of an SFT term (mean log-probability of the chosen answer) added to the preference loss."
    )
    dpo_label_smoothing: NonNegFloat = describe(
        0.0, "Label smoothing of the sigmoid DPO loss (robust DPO), in [0, 0.5]."
    )
    simpo_gamma: NonNegFloat = describe(0.5, "SimPO's target reward margin gamma.")
    pref_ref_logps: Literal["model", "precompute"] = describe(
        "model",
        "Where a reference-based preference loss reads the reference log-probabilities: model (a reference "
        "forward every step) or precompute (one pass over the data before step 1, saved and reused; the "
        "reference model is then freed; train/reference_table.py).",
    )
    calculate_per_token_loss: Bool = describe(
        False, "MindSpeed switch; meshforge always normalises the loss by the global valid-token count."
    )
    router_aux_loss_coef: NonNegFloat = describe(0.0, "Weight of the MoE router auxiliary loss.")
    indexer_loss_coeff: Float = describe(1.0, "Weight of the sparse-attention indexer loss (DSA models).")
    mtp_loss_scaling_factor: NonNegFloat = describe(0.3, "Weight of the multi-token-prediction loss.")
    log_throughput: Bool = describe(
        False, "Log throughput figures (MindSpeed key; meshforge logs tokens/s always)."
    )
    log_cpu_memory: Bool = describe(False, "Log host memory use every logged step.")

    @model_validator(mode="after")
    def _rules(self) -> TrainingConfig:
        ramp = self.rampup_batch_size
        if ramp is not None:
            ok = len(ramp) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in ramp)
            if not ok or ramp[0] <= 0 or ramp[1] <= 0 or ramp[2] < 0:
                raise rule_error(
                    "rampup_batch_size",
                    f"must be three integers [start > 0, increment > 0, samples >= 0], got {ramp}",
                )
            if self.gradient_accumulation_steps is not None:
                raise rule_error(
                    "rampup_batch_size",
                    "the ramp sets the accumulation steps of each step; it needs training.global_batch_size, "
                    "not training.gradient_accumulation_steps",
                )
            if self.global_batch_size is None:
                raise rule_error(
                    "rampup_batch_size", "the ramp ends at training.global_batch_size: set it too"
                )
            from meshforge.data.rampup import check_ramp

            try:
                check_ramp(ramp[0], ramp[1], self.global_batch_size)
            except ValueError as err:
                raise rule_error("rampup_batch_size", str(err).split(": ", 1)[1]) from None
        if self.dpo_label_smoothing > 0.5:
            raise rule_error("dpo_label_smoothing", f"must be in [0, 0.5], got {self.dpo_label_smoothing}")
        if self.pref_ref_logps == "precompute" and self.pref_loss in ("orpo", "simpo"):
            raise rule_error(
                "pref_ref_logps", f"precompute: pref_loss {self.pref_loss} has no reference model; use model"
            )
        if self.gradient_accumulation_steps is not None and self.global_batch_size is not None:
            raise rule_error(
                "gradient_accumulation_steps",
                "set either training.gradient_accumulation_steps or training.global_batch_size, not both",
            )
        return self

    def accumulation_steps(self, dp: int) -> int:
        """Micro-batches per optimizer step for `dp` data-parallel ranks.

        Without `global_batch_size` the global batch follows the world size (one micro-batch per
        rank and step, or `gradient_accumulation_steps` of them), as torchtitan and the HF Trainer
        do; with it, the world size must fit under it.

        Raises:
            ValueError: when `dp * local_batch_size > global_batch_size`.
        """
        if self.gradient_accumulation_steps is not None:
            return self.gradient_accumulation_steps
        if self.global_batch_size is None:
            return 1
        per_step = dp * self.local_batch_size
        if per_step > self.global_batch_size:
            raise ValueError(
                f"training.global_batch_size: {self.global_batch_size} is smaller than data-parallel size {dp} "
                f"x local_batch_size {self.local_batch_size} = {per_step}"
            )
        return self.global_batch_size // per_step

    def effective_global_batch_size(self, dp: int) -> int:
        """Samples per optimizer step for `dp` ranks (rounds down like the reference)."""
        return self.accumulation_steps(dp) * dp * self.local_batch_size
