"""The training loop: one `Trainer` for pretraining and SFT, with small overridable hooks.

Build order (DESIGN.md "A run, step by step"): process group and mesh -> tokenizer -> model on
the meta device -> parallelize (FSDP) -> materialise weights -> optimizer and schedule -> data
-> checkpoint (resume) -> metric sinks; the builders are in `trainer_build.py`. A component
receives its own config section and explicit arguments, never the whole config. To change one
piece of a step, subclass and override `forward_backward`, `clip_grads` or `log_step` instead of
copying `train_step`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from meshforge.config import TrainConfig, check_trainable, dump_config
from meshforge.config.noops import noop_notes
from meshforge.loss.cross_entropy import count_valid_tokens
from meshforge.loss.mtp import mtp_loss_sum
from meshforge.monitor.memory import memory_fields
from meshforge.monitor.throughput import throughput_fields
from meshforge.monitor.trackers import check_trackers
from meshforge.monitor.train_state import is_log_step
from meshforge.parallel.dims import ParallelDims
from meshforge.train.batches import BatchPlan, plan_batches
from meshforge.train.callback_runner import CallbackRunner
from meshforge.train.callbacks import TrainInfo, build_callbacks, builtin_callbacks
from meshforge.train.export import export_hf_from_checkpoint, export_hf_from_memory, export_lora_from_memory
from meshforge.train.health import HealthStopError, TrainingDivergedError, finite_or_none
from meshforge.train.monitors import TrainerMonitors
from meshforge.train.pipeline_eval import evaluate_pipeline, reshard_fsdp
from meshforge.utils import distributed as dist_utils
from meshforge.utils.comms import comm_stats_enabled
from meshforge.utils.device import backend_for, resolve_device
from meshforge.utils.log import get_logger
from meshforge.utils.resources import resolve_path
from meshforge.utils.seed import set_deterministic, set_seed

__all__ = ["BatchPlan", "HealthStopError", "TrainSummary", "Trainer", "TrainingDivergedError", "plan_batches"]


@dataclass
class TrainSummary:
    """What a finished run reports (also printed as the closing paragraph)."""

    steps: int
    final_loss: float
    tokens_per_s: float
    output_dir: Path
    last_checkpoint: Path | None
    losses: list[float] = field(default_factory=list)
    hf_export: Path | None = None
    preempted: bool = False


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a (replicated) DTensor result, e.g. the loss under loss parallel."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


class Trainer(TrainerMonitors):
    """Runs one training job described by a validated `TrainConfig`."""

    def __init__(self, cfg: TrainConfig, *, log: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.logger = get_logger("trainer")
        self.log = log or self.logger.info
        check_trainable(cfg, log=self.log)
        self.step = 0
        self.tokens_seen = 0
        self._hf_export: Path | None = None
        # MESHFORGE_COMM_STATS=1: count each step's collectives (benchmarks/parallel_overhead.py).
        self._count_comms = comm_stats_enabled()

    # ----------------------------------------------------------------------------- set-up
    def setup(self) -> None:
        cfg = self.cfg
        set_deterministic(cfg.training.deterministic)
        set_seed(cfg.training.seed)
        self.dist = dist_utils.env_dist_info()
        self.device = resolve_device(cfg.context.device_target, local_rank=self.dist.local_rank)
        if cfg.context.device() == "auto":
            # check_trainable warned about the keys that are no-ops everywhere; now the device is
            # known, so are the ones that are no-ops on it (cpu_offload on the CPU, ...).
            known = noop_notes(cfg, "auto")
            for path, note in noop_notes(cfg, self.device.type):
                if (path, note) not in known:
                    self.log(f"warning: {path}: {note}")
        dist_utils.init_process_group(backend_for(self.device), self.dist)
        self.dims = ParallelDims.from_config(cfg.parallelism, self.dist.world_size)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.plan, batch_note = plan_batches(cfg.training, self.dims.dp)
        if batch_note:
            self.log(f"warning: {batch_note}")

        self.output_dir = resolve_path(cfg.training.output_dir)
        if self.dist.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.yaml").write_text(dump_config(cfg))
        # User callbacks and tracker packages resolve (and fail, naming the item) before anything
        # heavy is built.
        check_trackers(cfg.monitor)
        self.callbacks = CallbackRunner(
            build_callbacks(cfg.callbacks), rank=self.dist.rank, device=self.device
        )
        self.builtin_callbacks = builtin_callbacks(cfg.monitor, cfg.callbacks, warn=self.log)
        self.log(
            f"meshforge: {self.dims.describe()} on {self.device.type} | global batch "
            f"{self.plan.global_batch_size} = dp {self.plan.data_parallel} x local {self.plan.local_batch_size} "
            f"x accumulation {self.plan.grad_accum_steps} | output {self.output_dir}"
        )

        self.rampup = self._build_rampup()
        self.tokenizer = self._build_tokenizer()
        self.model = self._build_model()
        self.loader = self._build_data()
        self.total_steps = self._resolve_total_steps()
        self.eval_loader = self._build_eval_data()
        self.optimizer, self.scheduler = self._build_optimizer()
        self.grad_accum = self._build_grad_accumulation()
        self.pipeline = self._build_pipeline()
        self.data_iter = iter(self.loader)
        self.checkpointer = self._build_checkpointer()
        self._maybe_resume()
        self._build_metric_sinks()
        self._build_metrics_logger()
        self._build_monitors()

    # ----------------------------------------------------------------------------- hooks
    def forward_backward(self, batch: dict[str, torch.Tensor], normalizer: torch.Tensor) -> torch.Tensor:
        """Forward one micro-batch, backward its share of the global mean; return its loss sum."""
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
            objective = objective + self.aux_coef * aux * weight
        if self.mtp_coef:
            mtp = (
                mtp_loss_sum(self.model, batch, lm_loss=self.lm_loss, loss_context=self._loss_context())
                / normalizer
            )
            self._mtp_sum += _plain(mtp).detach()
            objective = objective + self.mtp_coef * mtp
        with self._loss_context():
            objective.backward()
        return _plain(loss_sum).detach()

    def _loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward one batch and return its summed token cross-entropy (the training and eval loss)."""
        inputs = {k: batch[k] for k in ("position_ids", "segment_ids", *self._cp_model_kwargs) if k in batch}
        autocast = self.compute_dtype != torch.float32 and not self.fsdp
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=autocast):
            if self.lm_loss.needs_hidden:
                # Read lm_head.weight after the forward: under FSDP the root's parameters are
                # unsharded by then (the root keeps them until backward).
                hidden = self.model(batch["input_ids"], return_hidden=True, **inputs)
                # Every family's output projection (transformers' too) is an nn.Linear `lm_head`.
                head = cast(torch.nn.Linear, self.model.lm_head)
                return self.lm_loss(hidden, batch["labels"], head.weight)
            logits = self.model(batch["input_ids"], **inputs)
        with self._loss_context():
            return self.lm_loss(logits, batch["labels"])

    def _loss_context(self) -> contextlib.AbstractContextManager[None]:
        """Loss-parallel context under TP with `enable_loss_parallel` (vocab-sharded logits)."""
        if self.dims.tp == 1 or not self.cfg.parallelism.enable_loss_parallel:
            return contextlib.nullcontext()
        from meshforge.parallel.tensor import loss_parallel_context

        return loss_parallel_context(True)

    def _aux_loss(self) -> torch.Tensor | None:
        """The model's auxiliary (MoE router) loss of the last forward, if it has one and it counts."""
        get = getattr(self.model, "aux_loss", None)
        if not callable(get) or self.aux_coef == 0.0:
            return None
        return get()

    def clip_grads(self) -> torch.Tensor:
        """Clip the global gradient norm to `training.max_norm`; return the pre-clip norm."""
        from meshforge.optim.clip import clip_grad_norm_

        counted, uncounted = self._norm_parameters()
        return clip_grad_norm_(
            counted,
            self.cfg.training.max_norm,
            reduce_group=self.mesh.view("pp").get_group() if self.dims.pp > 1 else None,
            uncounted=uncounted,
        )

    def _norm_parameters(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Parameters whose gradients count in the global norm, and copies that are only clipped.

        Under pipeline parallelism a tied `lm_head.weight` on the last stage is a copy of the
        first stage's embedding with the same (summed) gradient: count it once.
        """
        params = dict(self.model.named_parameters())
        copies = set(self.pipeline_split.tied_copies if self.pipeline_split is not None else ())
        counted: list[torch.Tensor] = [p for name, p in params.items() if name not in copies]
        uncounted: list[torch.Tensor] = [p for name, p in params.items() if name in copies]
        return counted, uncounted

    def log_step(self, record: dict[str, Any]) -> None:
        """Write one step's metrics to every sink (rank 0 only): the built-in `MetricsLogger`."""
        self.metrics_logger.on_step_end(record)
        self.metrics_logger.write_expert_counts(self._moe_lines)
        self._moe_lines = []

    # ----------------------------------------------------------------------------- loop
    def train_step(self) -> dict[str, Any]:
        """One optimizer step over `grad_accum_steps` micro-batches (the ramp's count while it lasts)."""
        ramp = self.rampup
        count = ramp.accumulation_at(self.step + 1) if ramp is not None else self.plan.grad_accum_steps
        micro = [self._to_device(next(self.data_iter)) for _ in range(count)]
        step_tokens = sum(int(mb["input_ids"].numel()) for mb in micro) * self.dims.dp
        if self.dims.cp > 1:
            micro = [self._shard_for_cp(mb) for mb in micro]
        local_tokens = sum(count_valid_tokens(mb["labels"]) for mb in micro)
        loss_group = self.mesh.view("loss").get_group()
        global_tokens = dist_utils.all_reduce_sum(
            torch.as_tensor(local_tokens, device=self.device), loss_group
        )
        global_tokens = global_tokens.clamp(min=1).to(torch.float32)
        # What this rank divides its loss sum by; the summed gradients are then the gradient of
        # the global token mean, or of the mean of per-rank means (disable_gradient_division off).
        normalizer = self._loss_normalizer(local_tokens, global_tokens)
        self._aux_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        self._mtp_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        if self.moe_monitor is not None:
            self.moe_monitor.begin(self.step + 1)
        phase = self._phase("forward_backward")
        if self.pipeline is not None:
            # The schedule runs forward and backward of every micro-batch over the stages and
            # returns the CE sum on every pipeline rank.
            with phase:
                loss_sum = self.pipeline.step(micro, normalizer)
            if self._aux_loss_enabled:
                self._aux_sum = self._aux_sum + self.pipeline.aux_sum
            self._mtp_sum = self._mtp_sum + self.pipeline.mtp_sum
        else:
            loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
            with phase:
                for mb in micro:
                    loss_sum += self.forward_backward(mb, normalizer)
                    self.grad_accum.after_micro_batch()
                self.grad_accum.finish()
        if self.fsdp and self._ignored_params:
            from meshforge.parallel.fsdp import sync_ignored_grads

            # Parameters FSDP leaves alone (parallelism.ignored_modules): sum their gradients here.
            sync_ignored_grads(self.model, loss_group)
        loss = dist_utils.all_reduce_sum(loss_sum / normalizer, loss_group)
        extra: dict[str, float] = {}
        if self._aux_loss_enabled:
            extra["aux_loss"] = float(dist_utils.all_reduce_sum(self._aux_sum, loss_group))
        if self.mtp_coef:
            extra["mtp_loss"] = float(dist_utils.all_reduce_sum(self._mtp_sum, loss_group))
        if self.train_state is not None and is_log_step(
            self.step + 1, self.cfg.training.log_interval, self.total_steps
        ):
            extra.update(
                self.train_state.collect(
                    self.model,
                    loss_sum=float(_plain(loss_sum)),
                    local_tokens=int(local_tokens),
                    normalizer=float(normalizer),
                )
            )
        embedding_norm = self.health.embedding_local_norm(self.model)  # before clipping
        with self._phase("clip_grads"):
            grad_norm = self.clip_grads()
        loss_value, norm_value = float(loss), float(grad_norm)
        # Decided over the world before the update: a skipped step (non-finite, or above
        # monitor.health_checkpoint's threshold) changes neither the weights nor the schedule.
        self._verdict = verdict = self.health.decide(
            loss_value, norm_value, embedding_norm, stop_requested=self.preemption.requested
        )
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not verdict.skip:
            # A background save may still be copying the weights this step updates in place.
            self.checkpointer.wait_staging()
            with self._phase("optimizer"):
                self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.moe_monitor is not None:
            moe_fields, self._moe_lines = self.moe_monitor.end(self.step + 1)
            extra.update(moe_fields)
        record: dict[str, Any] = {
            "loss": finite_or_none(loss_value),
            "lr": lr,
            "grad_norm": finite_or_none(norm_value),
            "tokens": step_tokens,
            "valid_tokens": int(global_tokens.item()),
            **({"swap_bytes": am.swap_bytes()} if (am := self.activation_memory) and am.swapped else {}),
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

    def _loss_normalizer(self, local_tokens: torch.Tensor | int, global_tokens: torch.Tensor) -> torch.Tensor:
        """The divisor of this rank's loss sum for one optimizer step.

        Default (`parallelism.disable_gradient_division: true`, FSDP sums): the global valid-token
        count, so the gradients summed over micro-batches and ranks are those of the global
        token mean, the same for any layout. With `false` (MindSpeed: FSDP averages over the
        data ranks) each data rank takes the mean over its own tokens (summed over its context-
        parallel ranks, which share its rows) and the ranks are averaged: the tokens of a data
        rank with short rows weigh more, as in a DDP/HF Trainer run without token averaging.
        """
        if self.cfg.parallelism.disable_gradient_division:
            return global_tokens
        own = torch.as_tensor(local_tokens, device=self.device)
        if self.dims.cp > 1:
            own = dist_utils.all_reduce_sum(own, self.mesh.view("cp").get_group())
        return own.clamp(min=1).to(torch.float32) * float(self.dims.dp)

    def train(self) -> TrainSummary:
        """Run from the current step to the last one, saving, evaluating and logging as configured."""
        total = self.total_steps
        if self.step >= total:
            self.log(f"nothing to do: resumed at step {self.step} >= training.steps {total}")
        start_time = time.perf_counter()
        start_step = self.step
        losses: list[float] = []
        run_tokens = 0
        self.model.train()
        self.preemption.install()
        self._callback_stop = False
        try:
            info = TrainInfo(
                self.dist.rank, self.dist.world_size, self.dist.is_main, self.output_dir, self.step, total
            )
            for builtin in self.builtin_callbacks:
                builtin.on_train_start(info)
            self.callbacks.call("on_train_start", info)
            self.callbacks.agree()
            while self.step < total and not (self._verdict.preempted or self._callback_stop):
                run_tokens += self._run_one_step(total, start_time, losses)
            # A background save must be on disk (and marked complete) before the run ends. Not
            # on error paths: a failed peer would never reach the barrier inside.
            self.checkpointer.finalize()
            if self._verdict.preempted:
                self.log(f"preempted at step {self.step}: checkpoint {self.checkpoint_saver.last_path}")
            elif self.lora is not None and self.pipeline_split is None:
                self._hf_export = self._export_lora(merged=self.cfg.checkpoint.save_hf_weights)
            elif self.cfg.checkpoint.save_hf_weights:
                self._hf_export = self.export_hf(self.output_dir / "hf")
        finally:
            self.preemption.uninstall()
            self.close()
        wall = time.perf_counter() - start_time
        summary = TrainSummary(
            steps=self.step - start_step,
            final_loss=losses[-1] if losses else float("nan"),
            tokens_per_s=run_tokens / wall if wall > 0 else 0.0,
            output_dir=self.output_dir,
            last_checkpoint=self.checkpoint_saver.last_path,
            losses=losses,
            hf_export=self._hf_export,
            preempted=self._verdict.preempted,
        )
        for builtin in self.builtin_callbacks:
            builtin.on_train_end(summary)
        self.callbacks.call("on_train_end", summary)
        self.callbacks.agree()
        return summary

    def export_hf(self, out_dir: Path) -> Path:
        """Write the current weights, config and tokenizer as a HF folder (collective).

        A pipeline run exports from its final checkpoint: no rank holds every layer.
        """
        if self.pipeline_split is not None:
            return export_hf_from_checkpoint(
                self.checkpoint_saver.last_path,
                out_dir,
                config_path=self.output_dir / "config.yaml",
                is_main=self.dist.is_main,
                log=self.log,
            )
        return export_hf_from_memory(
            self.model,
            self.family,
            out_dir,
            tokenizer=self.tokenizer if self.dist.is_main else None,
            log=self.log,
        )

    def _export_lora(self, *, merged: bool) -> Path | None:
        """The PEFT adapter folder, and with `merged` the merged HF folder (returned; else None)."""
        assert self.cfg.lora_config is not None
        out = export_lora_from_memory(
            self.model,
            self.family,
            self.output_dir,
            section=self.cfg.lora_config,
            base_model=self.checkpointer.lora_base_path() or self.cfg.model.model_name_or_path,
            merged=merged,
            tokenizer=self.tokenizer if self.dist.is_main else None,
            log=self.log,
        )
        return out if merged else None

    def _phase(self, name: str) -> contextlib.AbstractContextManager[object]:
        """A named range in the profiler's trace inside its window; nothing otherwise."""
        return self.profiler.phase(name) if self.profiler is not None else contextlib.nullcontext()

    def _run_one_step(self, total: int, start_time: float, losses: list[float]) -> int:
        """Train, record, log and maybe save one step; return the tokens it processed."""
        for builtin in self.builtin_callbacks:
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
        self.step += 1
        elapsed = time.perf_counter() - t0
        self.tokens_seen += metrics["tokens"]
        record = {
            "step": self.step,
            **metrics,
            "tokens_per_s": metrics["tokens"] / max(elapsed, 1e-9),
            "tokens_seen": self.tokens_seen,
            "elapsed_s": time.perf_counter() - start_time,
            **memory_fields(self.device, host=self.cfg.training.log_cpu_memory),
        }
        if self.flops_per_token is not None:
            record.update(
                throughput_fields(
                    record["tokens_per_s"],
                    flops_per_token=self.flops_per_token,
                    world_size=self.dist.world_size,
                    peak=self.peak_flops,
                )
            )
        verdict = self._verdict
        warning = self.health.embedding_warning(verdict, self.step)
        if warning is not None:
            self.log(warning)
        if self.health.record(verdict, self.step):
            self.log_step(record)
            self._stop_unhealthy()
        if not verdict.skip:
            losses.append(metrics["loss"])
        if self._eval_due(total):
            eval_metrics = self.evaluate()
            record.update(eval_metrics)
            self.log(
                f"eval step {self.step}: eval_loss {record['eval_loss']:.4f} over {int(record['eval_tokens']):,} tokens"
            )
            self.callbacks.call("on_eval_end", eval_metrics)
        self.log_step(record)
        self.callbacks.call("on_step_end", record)
        # The built-ins in order: the checkpoint saver (interval, last and preempted steps), then
        # after the agreement on the callbacks' requests (one all-reduce, only with callbacks) a
        # requested save, and the profiler window's end of the step.
        for builtin in self.builtin_callbacks:
            builtin.on_step_end(record)
        save, self._callback_stop = self.callbacks.agree()
        for builtin in self.builtin_callbacks:
            builtin.on_step_close(self.step, save=save, stop=self._callback_stop)
        return int(metrics["tokens"])

    def _stop_unhealthy(self) -> None:
        """Save the last good state (skipped steps left the weights alone) and stop every rank."""
        path = self.checkpoint_saver.save()
        self.checkpointer.finalize()
        raise HealthStopError(self.health.stop_message(str(path)))

    def _eval_due(self, total: int) -> bool:
        if self.eval_loader is None:
            return False
        interval = self.cfg.training.eval_interval
        return self.step == total or (interval is not None and self.step % interval == 0)

    def evaluate(self) -> dict[str, float]:
        """Validation loss (global valid-token mean CE) over the whole validation loader."""
        from meshforge.train.evaluation import evaluate

        loader = self.eval_loader
        if loader is None:
            raise RuntimeError("evaluate: the run has no validation data")
        self.model.eval()
        try:
            if self.pipeline is not None:
                return evaluate_pipeline(
                    self.pipeline,
                    loader,
                    group_size=self.plan.grad_accum_steps,
                    max_batches=self.cfg.training.eval_iters,
                    device=self.device,
                    loss_group=self.mesh.view("loss").get_group(),
                    to_device=self._to_device,
                )
            return evaluate(
                self._eval_forward,
                loader,
                device=self.device,
                loss_group=self.mesh.view("loss").get_group(),
                max_batches=self.cfg.training.eval_iters,
            )
        finally:
            self.model.train()
            # A forward without backward leaves FSDP's root unsharded; the next training forward
            # must gather the weights the optimizer updates, so reshard now.
            reshard_fsdp(self.model)

    def _eval_forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """CE sum and valid-token count of one validation batch (sharded for CP first)."""
        if self.dims.cp > 1:
            batch = self._shard_for_cp(batch)
        loss_sum = self._loss_sum(batch)
        return _plain(loss_sum).detach(), count_valid_tokens(batch["labels"])

    @property
    def _cp_model_kwargs(self) -> tuple[str, ...]:
        """Extra batch keys the CP attention needs from `shard_batch_for_cp` (none without CP)."""
        if self.dims.cp == 1:
            return ()
        from meshforge.parallel.context import CP_MODEL_KWARGS

        return tuple(CP_MODEL_KWARGS)

    def _shard_for_cp(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from meshforge.parallel.context import shard_batch_for_cp

        return shard_batch_for_cp(batch, self.mesh.view("cp"), method=self.cfg.parallelism.cp_method())

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy a batch to the device; on an accelerator from pinned memory (`train_dataset.pin_memory`).

        A copy from pageable memory is synchronous whatever `non_blocking` says; pinning first
        lets it overlap with the step's compute.
        """
        if self.device.type == "cpu":
            return batch
        pin = self.cfg.train_dataset.pin_memory
        return {k: (v.pin_memory() if pin else v).to(self.device, non_blocking=pin) for k, v in batch.items()}

    def close(self) -> None:
        self.checkpointer.close()
        self.metrics_logger.close()
        if self.moe_monitor is not None:
            self.moe_monitor.close()
            self.moe_monitor = None
        if self.profiler is not None:
            self.profiler.close()
            self.profiler = None
