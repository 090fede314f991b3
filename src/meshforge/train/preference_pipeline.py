"""Preference pairs under pipeline parallelism: the pair loss on the last stage (`Pipeline.stage_loss`).

The pipeline's last stage computes, in place of the LM loss, each micro-batch's pair
log-probabilities from its output (logits, or the normed hidden states and the head chunk by
chunk) and the pair loss of `train/preference.py`, divided by the step's pair count as the
trainer's normalizer. Its target is the micro-batch's labels, segment ids and index, stacked per
row, so the loss finds the micro-batch's reference log-probabilities whatever order the schedule
runs it in (and a shape-inference call of the schedule, on micro-batch 0, is overwritten by the
real one).

The reference runs first in every schedule call, as a forward-only pass over the same stage
split: with LoRA the policy's own pipeline with its adapters off, with full fine-tuning a second
pipeline over the frozen copy (built as the policy is, so split, sharded and tied alike). Its last
stage keeps the reference log-probabilities per micro-batch. The metric sums of each micro-batch
are kept per index and, after the schedule, summed in micro-batch order (one process's order) and
all-reduced over the pp group, so every pipeline rank holds the step's sums for the trainer's
reduction over the `loss` mesh. The router aux loss of an MoE policy comes from the totals the
stages carry (`Pipeline._aux_from_carry`), weighted by the micro-batch's pairs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshforge.loss.preference import METRIC_KEYS, PairLogps
from meshforge.train.evaluation import reshard_fsdp

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.config.root import TrainConfig
    from meshforge.parallel.pipeline import Pipeline
    from meshforge.train.preference import PreferenceStep
    from meshforge.train.run import ModelParts, RunEnv

Batch = dict[str, torch.Tensor]


@dataclass
class PipelinePairs:
    """The `StageLoss` of a preference run (see the module docstring).

    Attributes:
        step: the run's preference step (loss, metrics, CP side).
        reference: the frozen copy's pipeline (full fine-tuning); None: LoRA's adapters-off
            policy, or a loss without a reference.
    """

    step: PreferenceStep
    reference: Pipeline | None = None
    _train: bool = True
    _recording: bool = False
    _ref: dict[int, PairLogps] = field(default_factory=dict)
    _sums: dict[int, torch.Tensor] = field(default_factory=dict)

    def target(self, micro: list[Batch]) -> torch.Tensor:
        """`[rows, 3, S]`: each row's labels, segment ids and micro-batch index."""
        return torch.cat(
            [
                torch.stack([mb["labels"], mb["segment_ids"], torch.full_like(mb["labels"], i)], dim=1)
                for i, mb in enumerate(micro)
            ]
        )

    def units(self, micro_batch: Batch) -> torch.Tensor:
        return self.step.count_pairs(micro_batch)

    def shard(self, batch: Batch) -> Batch:
        """An evaluation batch as the trainer hands a training one to the pipeline (CP: this rank's slice)."""
        return self.step.cp.shard(batch) if self.step.cp is not None else batch

    def begin(self, pipeline: Pipeline, micro: list[Batch], *, train: bool) -> None:
        """The reference's forward over the same micro-batches (the last stage keeps its log-probabilities)."""
        self._train = train
        self._sums.clear()
        if not self.step.loss.needs_reference:
            return
        self._ref.clear()
        self._recording = True
        try:
            if self.reference is not None:
                self.reference.forward_only(micro)
            else:
                from meshforge.lora.layer import adapters_disabled

                with adapters_disabled(pipeline.model) if self.step.lora else contextlib.nullcontext():
                    pipeline.forward_only(micro)
                # A forward without backward leaves FSDP's root unsharded: the policy's step gathers again.
                reshard_fsdp(pipeline.model)
        finally:
            self._recording = False

    def __call__(
        self,
        output: torch.Tensor,
        target: torch.Tensor,
        normalizer: torch.Tensor,
        aux: torch.Tensor | None,
        head: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        index = int(target[0, 2, 0])
        batch = {"labels": target[:, 0], "segment_ids": target[:, 1]}
        logps, present = self.step.logps_of(output, batch, head)
        zero = torch.zeros((), dtype=torch.float32, device=output.device)
        if self._recording:
            self._ref[index] = PairLogps(
                logps.chosen.detach(), logps.rejected.detach(), logps.chosen_tokens, logps.rejected_tokens
            )
            return zero, zero
        reference = self._ref.get(index) if self.step.loss.needs_reference else None
        if self.step.loss.needs_reference and reference is None:
            raise RuntimeError(f"pipeline pair loss: no reference log-probabilities for micro-batch {index}")
        if not self._train:
            loss_sum, sums = self.step.eval_loss(logps, present, reference)
            self._sums[index] = sums
            return loss_sum, loss_sum.detach()
        objective, loss_sum, sums = self.step.pair_loss(logps, present, reference, normalizer, aux)
        self._sums[index] = sums
        return objective, loss_sum

    def end(self, pipeline: Pipeline, *, train: bool) -> None:
        """The micro-batches' metric sums in order, on every pipeline rank (one all-reduce)."""
        size = 2 + len(self.step.keys) if train else 1 + len(METRIC_KEYS)
        total = torch.zeros(size, dtype=torch.float32, device=pipeline.device)
        kept = [self._sums[i] for i in sorted(self._sums)]
        if kept:
            total = kept[0]
            for sums in kept[1:]:
                total = total + sums
        total = total.detach().clone()
        dist.all_reduce(total, group=pipeline.group)
        self.step.keep(total, evaluation=not train)
        self._sums.clear()
        self._ref.clear()


def attach_pipeline_pairs(
    cfg: TrainConfig,
    env: RunEnv,
    parts: ModelParts,
    pipeline: Pipeline | None,
    step: PreferenceStep | None,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """Give a preference run's pipeline the pair loss, and a full fine-tuning run its reference pipeline."""
    if pipeline is None or step is None:
        return
    reference = None
    if step.loss.needs_reference and not step.lora:
        import dataclasses

        from meshforge.parallel.pipeline import build_pipeline
        from meshforge.train.build_model import build_model

        quiet = dataclasses.replace(env, log=lambda _line: None)
        frozen = build_model(cfg, quiet, tokenizer)
        assert frozen.pipeline_split is not None, "the reference is split as the policy"
        frozen.module.requires_grad_(False)
        frozen.module.eval()
        reference = build_pipeline(
            frozen.pipeline_split,
            frozen.module,
            env.mesh.view("pp"),
            device=env.device,
            n_microbatches=env.plan.grad_accum_steps,
            schedule=cfg.parallelism.pipeline_parallel_schedule,
            dxdw_split=cfg.parallelism.pipeline_parallel_enable_dxdw_split,
            lm_loss=parts.lm_loss,
        )
    pairs = PipelinePairs(step, reference)
    pipeline.stage_loss = pairs
    if reference is not None:
        reference.stage_loss = pairs
