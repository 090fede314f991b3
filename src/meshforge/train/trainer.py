"""The training loop: one `Trainer` for pretraining and SFT, with small overridable hooks.

`setup` builds the run's parts with `build_run` (`build.py`, in DESIGN.md's order) and holds
the one `Run` it returns; the loop reads the parts from it and keeps only its own moving state
(the step, the data iterator, the per-step sums). A component receives its own config section
and explicit arguments, never the whole config. To change one piece of a step, subclass and
override `forward_backward`, `clip_grads` or `log_step` instead of copying `train_step`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch

from meshforge.config import ConfigError, TrainConfig, check_trainable
from meshforge.data.inputs import input_issues
from meshforge.loss.cross_entropy import count_valid_tokens
from meshforge.loss.mtp import mtp_loss_sum
from meshforge.monitor.memory import memory_fields
from meshforge.monitor.stragglers import step_time_spread
from meshforge.monitor.throughput import throughput_fields
from meshforge.monitor.train_state import is_log_step
from meshforge.train.batches import (
    BatchPlan,
    cp_model_kwargs,
    plan_batches,
    rank_mean_normalizer,
    shard_for_cp,
    to_device,
)
from meshforge.train.build import build_run
from meshforge.train.callbacks import TrainInfo
from meshforge.train.evaluation import eval_line, reshard_fsdp
from meshforge.train.export import export_dir, export_run_hf, export_run_lora
from meshforge.train.health import HealthStopError, StepVerdict, TrainingDivergedError, finite_or_none
from meshforge.train.rerun import StepResult, ranks_that_changed, reproduced, rerun_line
from meshforge.train.run import Progress, Run, TrainSummary
from meshforge.train.watchdog import StepWatchdog
from meshforge.utils import distributed as dist_utils
from meshforge.utils.comms import comm_stats_enabled
from meshforge.utils.log import get_logger
from meshforge.utils.seed import RNGState, rng_state, set_rng_state

__all__ = ["BatchPlan", "HealthStopError", "TrainSummary", "Trainer", "TrainingDivergedError", "plan_batches"]

Batch = dict[str, torch.Tensor]


def count_valid_tokens_of(batch: Batch) -> torch.Tensor:
    """The valid (labelled) tokens of a micro-batch: what the LM loss is a mean over."""
    return count_valid_tokens(batch["labels"])


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a (replicated) DTensor result, e.g. the loss under loss parallel."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


class Trainer:
    """Runs one training job described by a validated `TrainConfig`."""

    run: Run
    # The next micro-batches: replaceable (tests feed their own batches through it).
    data_iter: Iterator[Batch]
    # This step's router and MTP loss sums (logged as aux_loss / mtp_loss), reset by train_step.
    _aux_sum: torch.Tensor
    _mtp_sum: torch.Tensor

    def __init__(
        self, cfg: TrainConfig, *, log: Callable[[str], None] | None = None, check_inputs: bool = True
    ) -> None:
        """`check_inputs: False` skips the data and checkpoint path checks (a dry run reads no data)."""
        self.cfg = cfg
        self.log = log or get_logger("trainer").info
        check_trainable(cfg, log=self.log)
        # Missing data, model or checkpoint paths: one error naming each key, as validate says.
        missing = input_issues(cfg) if check_inputs else []
        if missing:
            raise ConfigError(missing)
        self._hf_export: Path | None = None
        # MESHFORGE_COMM_STATS=1: count each step's collectives (benchmarks/parallel_overhead.py).
        self._count_comms = comm_stats_enabled()
        # The loop's position; after setup the run's own (resumed) one, which the saver reads.
        self.progress = Progress()
        self._moe_lines: list[dict[str, Any]] = []
        self._callback_stop = False
        self._watchers_closed = False

    @property
    def model(self) -> torch.nn.Module:
        """The run's (parallelised) model."""
        return self.run.model.module

    @property
    def step(self) -> int:
        """Optimizer steps done, counting those before a resume."""
        return self.progress.step

    # ----------------------------------------------------------------------------- set-up
    def setup(self) -> None:
        """Build the run (collective) and start the data stream at the resumed position."""
        self.run = build_run(self.cfg, self.log)
        self.progress = self.run.progress
        self.data_iter = iter(self.run.data.loader)

    # ----------------------------------------------------------------------------- hooks
    def forward_backward(self, batch: dict[str, torch.Tensor], normalizer: torch.Tensor) -> torch.Tensor:
        """Forward one micro-batch, backward its share of the global mean; return its loss sum."""
        parts = self.run.model
        if self.run.preference is not None:  # stage dpo: pairs, not tokens (train/preference.py)
            return self.run.preference.forward_backward(self.model, batch, normalizer)
        loss_sum = self._loss_sum(batch)
        # Dividing by the global token count (not the local one) makes the summed gradients over
        # micro-batches and ranks equal the gradient of the global-batch mean.
        objective = loss_sum / normalizer
        aux = self._aux_loss()
        if aux is not None:
            # The router loss is a per-micro-batch mean: weight it by this micro-batch's share of
            # the global valid tokens, so that one micro-batch on one rank gives exactly
            # transformers' `loss + coef * aux`, and accumulation/data parallelism average it.
            weight = count_valid_tokens(batch["labels"]).to(normalizer.dtype) / normalizer
            self._aux_sum += aux.detach().float() * weight
            objective = objective + parts.aux_coef * aux * weight
        if parts.mtp_coef:
            mtp = (
                mtp_loss_sum(self.model, batch, lm_loss=parts.lm_loss, loss_context=self._loss_context())
                / normalizer
            )
            self._mtp_sum += _plain(mtp).detach()
            objective = objective + parts.mtp_coef * mtp
        with self._loss_context():
            objective.backward()
        return _plain(loss_sum).detach()

    def _loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward one batch and return its summed token cross-entropy (the training and eval loss)."""
        parts, device = self.run.model, self.run.env.device
        inputs = {
            k: batch[k]
            for k in ("position_ids", "segment_ids", *cp_model_kwargs(self.run.env.dims.cp))
            if k in batch
        }
        autocast = parts.compute_dtype != torch.float32 and not parts.fsdp
        with torch.autocast(device.type, dtype=parts.compute_dtype, enabled=autocast):
            if parts.lm_loss.needs_hidden:
                # Read lm_head.weight after the forward: under FSDP the root's parameters are
                # unsharded by then (the root keeps them until backward).
                hidden = self.model(batch["input_ids"], return_hidden=True, **inputs)
                # Every family's output projection (transformers' too) is an nn.Linear `lm_head`.
                head = cast(torch.nn.Linear, self.model.lm_head)
                return parts.lm_loss(hidden, batch["labels"], head.weight)
            logits = self.model(batch["input_ids"], **inputs)
        with self._loss_context():
            return parts.lm_loss(logits, batch["labels"])

    def _loss_context(self) -> contextlib.AbstractContextManager[None]:
        """Loss-parallel context under TP with `enable_loss_parallel` (vocab-sharded logits)."""
        if self.run.env.dims.tp == 1 or not self.cfg.parallelism.enable_loss_parallel:
            return contextlib.nullcontext()
        from meshforge.parallel.tensor import loss_parallel_context

        return loss_parallel_context(True)

    def _aux_loss(self) -> torch.Tensor | None:
        """The model's auxiliary (MoE router) loss of the last forward, if it has one and it counts."""
        get = getattr(self.model, "aux_loss", None)
        if not callable(get) or self.run.model.aux_coef == 0.0:
            return None
        return get()

    def clip_grads(self) -> torch.Tensor:
        """Clip the global gradient norm to `training.max_norm`; return the pre-clip norm."""
        from meshforge.optim.clip import clip_grad_norm_

        env = self.run.env
        counted, uncounted = self.run.model.norm_parameters()
        return clip_grad_norm_(
            counted,
            self.cfg.training.max_norm,
            reduce_group=env.mesh.view("pp").get_group() if env.dims.pp > 1 else None,
            uncounted=uncounted,
        )

    def log_step(self, record: dict[str, Any]) -> None:
        """Write one step's metrics to every sink (rank 0 only): the built-in `MetricsLogger`."""
        metrics_logger = self.run.watch.metrics_logger
        metrics_logger.on_step_end(record)
        metrics_logger.write_expert_counts(self._moe_lines)
        self._moe_lines = []

    # ----------------------------------------------------------------------------- loop
    def train_step(self) -> dict[str, Any]:
        """One optimizer step over `grad_accum_steps` micro-batches (the ramp's count while it lasts)."""
        env, parts, optim, watch = self.run.env, self.run.model, self.run.optim, self.run.watch
        device, dims, replicas = env.device, env.dims, self.run.replicas
        if replicas is not None:
            replicas.start_step()  # torchft quorum; a group that is behind recovers from a peer here
        ramp = self.run.data.rampup
        count = ramp.accumulation_at(self.step + 1) if ramp is not None else env.plan.grad_accum_steps
        micro = [self._to_device(next(self.data_iter)) for _ in range(count)]
        step_tokens = sum(int(mb["input_ids"].numel()) for mb in micro) * dims.dp
        if dims.cp > 1:
            micro = [self._shard_for_cp(mb) for mb in micro]
        # What the loss is a mean over: valid tokens, or pairs for preference training.
        units = self.run.preference.count_pairs if self.run.preference is not None else count_valid_tokens_of
        local_tokens = sum(units(mb) for mb in micro)
        loss_group = env.mesh.view("loss").get_group()
        global_tokens = dist_utils.all_reduce_sum(torch.as_tensor(local_tokens, device=device), loss_group)
        if replicas is not None:
            global_tokens = replicas.sum_tokens(global_tokens)  # over every live replica group
        global_tokens = global_tokens.clamp(min=1).to(torch.float32)
        # What this rank divides its loss sum by; the summed gradients are then the gradient of
        # the global token mean, or of the mean of per-rank means (disable_gradient_division off).
        normalizer = self._loss_normalizer(local_tokens, global_tokens)
        rerun = self.cfg.training.rerun_mode == "validate_results"
        rng_before = rng_state() if rerun else None
        result = self._compute_step(micro, normalizer, local_tokens)
        # Decided over the world before the update: a skipped step (non-finite, or above
        # monitor.health_checkpoint's threshold) changes neither the weights nor the schedule.
        verdict = watch.health.decide(
            result.loss, result.grad_norm, result.embedding_norm, stop_requested=watch.preemption.requested
        )
        rerun_kind = None
        if verdict.skip and rng_before is not None:
            result, verdict, rerun_kind = self._rerun_step(
                micro, normalizer, local_tokens, result, rng_before
            )
        self.progress.verdict = verdict
        loss_value, norm_value, extra = result.loss, result.grad_norm, result.extra
        if rerun_kind is not None:
            extra["rerun"] = rerun_kind
        lr = float(optim.optimizer.param_groups[0]["lr"])
        # torchft's vote: a step that a replica group failed in leaves the weights alone.
        committed = replicas is None or replicas.should_commit()
        if committed and not verdict.skip:
            # A background save may still be copying the weights this step updates in place.
            optim.checkpointer.wait_staging()
            with self._phase("optimizer"):
                optim.optimizer.step()
            optim.scheduler.step()
        optim.optimizer.zero_grad(set_to_none=True)
        if replicas is not None:
            extra.update(replicas.fields())
        if watch.moe_monitor is not None:
            moe_fields, self._moe_lines = watch.moe_monitor.end(self.step + 1)
            extra.update(moe_fields)
        record: dict[str, Any] = {
            "loss": finite_or_none(loss_value),
            "lr": lr,
            "grad_norm": finite_or_none(norm_value),
            "tokens": step_tokens,
            **({"valid_tokens": int(global_tokens.item())} if self.run.preference is None else {}),
            **({"swap_bytes": am.swap_bytes()} if (am := parts.activation_memory) and am.swapped else {}),
            **extra,
        }
        if ramp is not None:
            record.update(
                global_batch_size=ramp.batch_at(self.step + 1),
                consumed_samples=ramp.consumed_after(self.step + 1),
            )
        if verdict.skip:
            record.update(skipped=True, skip_reason=verdict.reason)
        return record

    def _compute_step(
        self, micro: list[Batch], normalizer: torch.Tensor, local_tokens: torch.Tensor | int
    ) -> StepResult:
        """Forward and backward of every micro-batch, the global loss and the clipped norm."""
        env, parts, watch = self.run.env, self.run.model, self.run.watch
        device = env.device
        loss_group = env.mesh.view("loss").get_group()
        self._aux_sum = torch.zeros((), device=device, dtype=torch.float32)
        self._mtp_sum = torch.zeros((), device=device, dtype=torch.float32)
        if watch.moe_monitor is not None:
            watch.moe_monitor.begin(self.step + 1)
        with self._phase("forward_backward"):
            loss_sum = self.backward_micro_batches(micro, normalizer)
        loss = dist_utils.all_reduce_sum(loss_sum / normalizer, loss_group)
        if self.run.replicas is not None:
            loss = self.run.replicas.reduce_step(self.model, loss)  # gradients and loss over the groups
        extra: dict[str, float | str] = {}
        if parts.aux_loss_enabled:
            extra["aux_loss"] = float(dist_utils.all_reduce_sum(self._aux_sum, loss_group))
        if parts.mtp_coef:
            extra["mtp_loss"] = float(dist_utils.all_reduce_sum(self._mtp_sum, loss_group))
        if self.run.preference is not None:
            extra.update(self.run.preference.step_metrics(loss_group))
        total = self.run.data.total_steps
        if watch.train_state is not None and is_log_step(
            self.step + 1, self.cfg.training.log_interval, total
        ):
            extra.update(
                watch.train_state.collect(
                    self.model,
                    loss_sum=float(_plain(loss_sum)),
                    local_tokens=int(local_tokens),
                    normalizer=float(normalizer),
                )
            )
        embedding_norm = watch.health.embedding_local_norm(self.model)  # before clipping
        with self._phase("clip_grads"):
            grad_norm = self.clip_grads()
        return StepResult(loss_sum, float(loss), float(grad_norm), embedding_norm, extra)

    def backward_micro_batches(self, micro: list[Batch], normalizer: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns this rank's loss sum as a tensor
        (`train/dry_run.py` runs this same code on fake tensors and never reads a value)."""
        parts, optim, device = self.run.model, self.run.optim, self.run.env.device
        if optim.pipeline is not None:
            # The schedule runs forward and backward of every micro-batch over the stages and
            # returns the CE sum on every pipeline rank.
            loss_sum = optim.pipeline.step(micro, normalizer)
            if parts.aux_loss_enabled:
                self._aux_sum = self._aux_sum + optim.pipeline.aux_sum
            self._mtp_sum = self._mtp_sum + optim.pipeline.mtp_sum
        else:
            loss_sum = torch.zeros((), device=device, dtype=torch.float32)
            for mb in micro:
                loss_sum += self.forward_backward(mb, normalizer)
                optim.grad_accum.after_micro_batch()
            optim.grad_accum.finish()
        if parts.fsdp and parts.ignored_params:
            from meshforge.parallel.fsdp import sync_ignored_grads

            # Parameters FSDP leaves alone (parallelism.ignored_modules): sum their gradients here.
            sync_ignored_grads(self.model, self.run.env.mesh.view("loss").get_group())
        return loss_sum

    def _rerun_step(
        self,
        micro: list[Batch],
        normalizer: torch.Tensor,
        local_tokens: torch.Tensor | int,
        first: StepResult,
        rng_before: RNGState,
    ) -> tuple[StepResult, StepVerdict, str]:
        """The bad step computed again from the same state and data (`train/rerun.py`)."""
        watch, step = self.run.watch, self.step + 1
        self.run.optim.optimizer.zero_grad(set_to_none=True)
        set_rng_state(rng_before)
        again = self._compute_step(micro, normalizer, local_tokens)
        verdict = watch.health.decide(
            again.loss, again.grad_norm, again.embedding_norm, stop_requested=watch.preemption.requested
        )
        real = reproduced(first, again)
        changed = [] if real else ranks_that_changed(first, again, self.run.env.device)
        self.log(rerun_line(step, first, again, changed, real=real))
        return again, verdict, "divergence" if real else "transient"

    def _loss_normalizer(self, local_tokens: torch.Tensor | int, global_tokens: torch.Tensor) -> torch.Tensor:
        """The divisor of this rank's loss sum for one optimizer step.

        Default (`parallelism.disable_gradient_division: true`, FSDP sums): the global valid-token
        count, so the gradients summed over micro-batches and ranks are those of the global
        token mean, the same for any layout; `false` is `rank_mean_normalizer`.
        """
        if self.cfg.parallelism.disable_gradient_division:
            return global_tokens
        env = self.run.env
        cp_group = env.mesh.view("cp").get_group() if env.dims.cp > 1 else None
        return rank_mean_normalizer(
            local_tokens, data_parallel=env.dims.dp, device=env.device, cp_group=cp_group
        )

    def train(self) -> TrainSummary:
        """Run from the current step to the last one, saving, evaluating and logging as configured."""
        env, watch, progress = self.run.env, self.run.watch, self.progress
        total = self.run.data.total_steps
        finished_before = self.step if self.step >= total else None
        if finished_before is not None:
            self.log(f"nothing to do: resumed at step {self.step} >= training.steps {total}")
        start_time = time.perf_counter()
        start_step = self.step
        losses: list[float] = []
        run_tokens = 0
        self.model.train()
        # training.step_timeout_s: a step that outlives it reports every rank and exits.
        self._watchdog = StepWatchdog(
            self.cfg.training.step_timeout_s,
            output_dir=env.output_dir,
            rank=env.dist.rank,
            world_size=env.dist.world_size,
            log=self.log,
        )
        self._watchdog.start()
        watch.preemption.install()
        self._callback_stop = False
        try:
            info = TrainInfo(
                env.dist.rank, env.dist.world_size, env.dist.is_main, env.output_dir, self.step, total
            )
            for builtin in watch.builtin_callbacks:
                builtin.on_train_start(info)
            watch.callbacks.call("on_train_start", info)
            watch.callbacks.agree()
            while self.step < total and not (progress.verdict.preempted or self._callback_stop):
                run_tokens += self._run_one_step(total, start_time, losses)
            # A background save must be on disk (and marked complete) before the run ends. Not
            # on error paths: a failed peer would never reach the barrier inside.
            self.run.optim.checkpointer.finalize()
            if progress.verdict.preempted:
                self.log(f"preempted at step {self.step}: checkpoint {watch.checkpoint_saver.last_path}")
            elif self.run.model.lora is not None and self.run.model.pipeline_split is None:
                self._hf_export = export_run_lora(
                    self.run, merged=self.cfg.checkpoint.save_hf_weights, log=self.log
                )
            elif self.cfg.checkpoint.save_hf_weights:
                self._hf_export = self.export_hf(export_dir(self.run, "hf"))
        finally:
            self._watchdog.close()
            watch.preemption.uninstall()
            self.close()
        wall = time.perf_counter() - start_time
        summary = TrainSummary(
            steps=self.step - start_step,
            final_loss=losses[-1] if losses else float("nan"),
            tokens_per_s=run_tokens / wall if wall > 0 else 0.0,
            output_dir=env.output_dir,
            last_checkpoint=watch.checkpoint_saver.last_path,
            losses=losses,
            hf_export=self._hf_export,
            preempted=progress.verdict.preempted,
            skipped=dict(watch.health.skipped),
            finished_before=finished_before,
        )
        for builtin in watch.builtin_callbacks:
            builtin.on_train_end(summary)
        watch.callbacks.call("on_train_end", summary)
        watch.callbacks.agree()
        return summary

    def export_hf(self, out_dir: Path) -> Path:
        """Write the current weights, config and tokenizer as a HF folder (collective).

        A pipeline run exports from its final checkpoint: no rank holds every layer.
        """
        return export_run_hf(self.run, out_dir, log=self.log)

    def _phase(self, name: str) -> contextlib.AbstractContextManager[object]:
        """A named range in the profiler's trace inside its window; nothing otherwise."""
        profiler = self.run.watch.profiler
        if profiler is None or self._watchers_closed:
            return contextlib.nullcontext()
        return profiler.phase(name)

    def _run_one_step(self, total: int, start_time: float, losses: list[float]) -> int:
        """Train, record, log and maybe save one step; return the tokens it processed."""
        env, parts, watch, progress = self.run.env, self.run.model, self.run.watch, self.progress
        with self._watchdog.step(self.step + 1):
            for builtin in watch.builtin_callbacks:
                builtin.on_step_begin(self.step + 1)
            t0 = time.perf_counter()
            if self._count_comms:
                from meshforge.utils.comms import CommCounter

                with CommCounter() as counter:
                    metrics = self.train_step()
                metrics["comm_bytes"] = counter.total_bytes
                metrics["comm_calls"] = counter.total_calls
            else:
                metrics = self.train_step()
        progress.step += 1
        elapsed = time.perf_counter() - t0
        if env.dist.world_size > 1 and is_log_step(self.step, self.cfg.training.log_interval, total):
            metrics.update(step_time_spread(elapsed, device=env.device))
        progress.tokens_seen += metrics["tokens"]
        record = {
            "step": self.step,
            **metrics,
            "tokens_per_s": metrics["tokens"] / max(elapsed, 1e-9),
            "tokens_seen": progress.tokens_seen,
            "elapsed_s": time.perf_counter() - start_time,
            **memory_fields(env.device, host=self.cfg.training.log_cpu_memory),
        }
        if parts.flops_per_token is not None:
            record.update(
                throughput_fields(
                    record["tokens_per_s"],
                    flops_per_token=parts.flops_per_token,
                    world_size=env.dist.world_size,
                    peak=parts.peak_flops,
                )
            )
        verdict = progress.verdict
        warning = watch.health.embedding_warning(verdict, self.step)
        if warning is not None:
            self.log(warning)
        if watch.health.record(verdict, self.step):
            self.log_step(record)
            self._stop_unhealthy()
        if not verdict.skip:
            losses.append(metrics["loss"])
        if self._eval_due(total):
            eval_metrics = self.evaluate()
            record.update(eval_metrics)
            self.log(f"eval step {self.step}: {eval_line(eval_metrics)}")
            watch.callbacks.call("on_eval_end", eval_metrics)
        self.log_step(record)
        watch.callbacks.call("on_step_end", record)
        # The built-ins in order: the checkpoint saver (interval, last and preempted steps), then
        # after the agreement on the callbacks' requests (one all-reduce, only with callbacks) a
        # requested save, and the profiler window's end of the step.
        for builtin in watch.builtin_callbacks:
            builtin.on_step_end(record)
        save, self._callback_stop = watch.callbacks.agree()
        for builtin in watch.builtin_callbacks:
            builtin.on_step_close(self.step, save=save, stop=self._callback_stop)
        return int(metrics["tokens"])

    def _stop_unhealthy(self) -> None:
        """Save the last good state (skipped steps left the weights alone) and stop every rank."""
        saver = self.run.watch.checkpoint_saver
        saver.save()
        self.run.optim.checkpointer.finalize()
        raise HealthStopError(self.run.watch.health.stop_message(str(saver.last_path)))

    def _eval_due(self, total: int) -> bool:
        if not self.run.data.eval_loaders:
            return False
        interval = self.cfg.training.eval_interval
        return self.step == total or (interval is not None and self.step % interval == 0)

    def evaluate(self) -> dict[str, float]:
        """Validation loss (global valid-token mean CE) over every validation loader, whole.

        Each named loader (one per evaluation dataset) is read in turn; their local sums are
        all-reduced together (`eval_metrics`). `training.eval_iters` limits each loader.
        """
        from meshforge.train.evaluation import eval_metrics, eval_sums, pipeline_eval_sums

        env, pipeline = self.run.env, self.run.optim.pipeline
        loaders = self.run.data.eval_loaders
        if not loaders:
            raise RuntimeError("evaluate: the run has no validation data")
        max_batches = self.cfg.training.eval_iters
        self.model.eval()
        try:
            sums = {}
            for name, loader in loaders.items():
                if pipeline is not None:
                    sums[name] = pipeline_eval_sums(
                        pipeline,
                        loader,
                        group_size=env.plan.grad_accum_steps,
                        max_batches=max_batches,
                        device=env.device,
                        to_device=self._to_device,
                    )
                else:
                    sums[name] = eval_sums(
                        self._eval_forward, loader, device=env.device, max_batches=max_batches
                    )
            group = env.mesh.view("loss").get_group()
            preference = self.run.preference
            if preference is None:
                return eval_metrics(sums, loss_group=group)
            # Preference runs: the mean pair loss over the validation pairs, and their rewards.
            return {**eval_metrics(sums, loss_group=group, unit="pairs"), **preference.eval_metrics(group)}
        finally:
            self.model.train()
            # A forward without backward leaves FSDP's root unsharded; the next training forward
            # must gather the weights the optimizer updates, so reshard now.
            reshard_fsdp(self.model)

    def _eval_forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """CE sum and valid-token count of one validation batch (sharded for CP first)."""
        if self.run.preference is not None:  # the pair loss sum and the pair count
            return self.run.preference.eval_forward(self.model, batch)
        if self.run.env.dims.cp > 1:
            batch = self._shard_for_cp(batch)
        loss_sum = self._loss_sum(batch)
        return _plain(loss_sum).detach(), count_valid_tokens(batch["labels"])

    def _shard_for_cp(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return shard_for_cp(batch, self.run.env.mesh.view("cp"), method=self.cfg.parallelism.cp_method())

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy a batch to the device (`train_dataset.pin_memory`: from pinned memory)."""
        return to_device(batch, self.run.env.device, pin=self.cfg.train_dataset.pin_memory)

    def close(self) -> None:
        """Flush and close the checkpointer and the sinks; the monitors and the profiler once."""
        watch = self.run.watch
        self.run.optim.checkpointer.close()
        if self.run.replicas is not None:
            self.run.replicas.close()
        watch.metrics_logger.close()
        if self._watchers_closed:
            return
        self._watchers_closed = True
        if watch.moe_monitor is not None:
            watch.moe_monitor.close()
        if watch.profiler is not None:
            watch.profiler.close()
