"""The training loop: one `Trainer` for pretraining and SFT, with small overridable hooks.

Build order (DESIGN.md "A run, step by step"): process group and mesh -> tokenizer -> model on
the meta device -> parallelize (FSDP) -> materialise weights -> optimizer and schedule -> data
-> checkpoint (resume) -> metric sinks. A component receives its own config section and explicit
arguments, never the whole config. To change one piece of a step, subclass and override
`forward_backward`, `clip_grads` or `log_step` instead of copying `train_step`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from meshforge.checkpoint.manager import CheckpointManager
from meshforge.config import TrainConfig, check_trainable, dump_config
from meshforge.loss import chunked_cross_entropy_sum, count_valid_tokens, cross_entropy_sum
from meshforge.models.common.kernels import (
    KernelOptions,
    apply_compile,
    configure_model_kernels,
    resolve_kernel_options,
)
from meshforge.monitor.console import ConsoleProgress
from meshforge.monitor.metrics import JsonlMetrics, TensorBoardMetrics
from meshforge.parallel.dims import ParallelDims
from meshforge.resources import resolve_path
from meshforge.utils import distributed as dist_utils
from meshforge.utils.comms import comm_stats_enabled
from meshforge.utils.device import backend_for, peak_memory_bytes, resolve_device
from meshforge.utils.log import get_logger
from meshforge.utils.seed import rng_state, set_deterministic, set_rng_state, set_seed

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(value: str | None, *, key: str, default: torch.dtype = torch.float32) -> torch.dtype:
    """Map a config dtype name to a torch dtype (the config already checked the spelling)."""
    if value is None:
        return default
    try:
        return _DTYPES[str(value).lower()]
    except KeyError:
        raise ValueError(f"{key}: unknown dtype {value!r}; valid: {', '.join(_DTYPES)}") from None


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch is split (DESIGN.md: GA = gbs // (dp * lbs))."""

    local_batch_size: int
    data_parallel: int
    grad_accum_steps: int

    @property
    def global_batch_size(self) -> int:
        return self.local_batch_size * self.data_parallel * self.grad_accum_steps


def plan_batches(training: Any, data_parallel: int) -> tuple[BatchPlan, str | None]:
    """Derive gradient accumulation from the `training` section; returns the plan and a note.

    Raises:
        ValueError: when `data_parallel * local_batch_size > global_batch_size`.
    """
    local = int(training.local_batch_size)
    accum = getattr(training, "gradient_accumulation_steps", None)
    if accum is not None:
        return BatchPlan(local, data_parallel, int(accum)), None
    global_bs = int(training.global_batch_size)
    per_micro = data_parallel * local
    if per_micro > global_bs:
        raise ValueError(
            f"training.global_batch_size: {global_bs} is smaller than data-parallel ranks ({data_parallel}) "
            f"x training.local_batch_size ({local}) = {per_micro}"
        )
    plan = BatchPlan(local, data_parallel, global_bs // per_micro)
    note = None
    if global_bs % per_micro:
        note = (
            f"training.global_batch_size {global_bs} is not a multiple of data-parallel ranks ({data_parallel}) "
            f"x local_batch_size ({local}); using {plan.global_batch_size} (as the reference does)"
        )
    return plan, note


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


def _model_vocab_size(family: Any, options: dict[str, Any]) -> int:
    """The embedding rows the model would have before any tokenizer extension."""
    parse = getattr(family, "parse_options", None)
    if callable(parse):
        return int(parse(options).vocab_size)
    return int(options["vocab_size"])


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a (replicated) DTensor result, e.g. the loss under loss parallel."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def _reshard_fsdp(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _no_init(fqn: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    """Leave a parameter uninitialised: weights loaded right after overwrite it."""


class Trainer:
    """Runs one training job described by a validated `TrainConfig`."""

    def __init__(self, cfg: TrainConfig, *, log: Callable[[str], None] | None = None) -> None:
        check_trainable(cfg)
        self.cfg = cfg
        self.logger = get_logger("trainer")
        self.log = log or self.logger.info
        self.step = 0
        self.tokens_seen = 0
        self._last_checkpoint: Path | None = None
        self._hf_export: Path | None = None
        # MESHFORGE_COMM_STATS=1: count each step's collectives (benchmarks/parallel_overhead.py).
        self._count_comms = comm_stats_enabled()

    # ----------------------------------------------------------------------------- set-up
    def setup(self) -> None:
        cfg = self.cfg
        set_deterministic(bool(cfg.training.deterministic))
        set_seed(int(cfg.training.seed))
        self.dist = dist_utils.env_dist_info()
        self.device = resolve_device(cfg.context.device_target, local_rank=self.dist.local_rank)
        dist_utils.init_process_group(backend_for(self.device), self.dist)
        self.dims = ParallelDims.from_config(cfg.parallelism, self.dist.world_size)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.plan, note = plan_batches(cfg.training, self.dims.dp)
        if note:
            self.log(f"warning: {note}")

        self.output_dir = resolve_path(cfg.training.output_dir)
        if self.dist.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.yaml").write_text(dump_config(cfg))
        self.log(
            f"meshforge: {self.dims.describe()} on {self.device.type} | global batch "
            f"{self.plan.global_batch_size} = dp {self.plan.data_parallel} x local {self.plan.local_batch_size} "
            f"x accumulation {self.plan.grad_accum_steps} | output {self.output_dir}"
        )

        self.tokenizer = self._build_tokenizer()
        self.model = self._build_model()
        self.loader = self._build_data()
        self.total_steps = self._resolve_total_steps()
        self.eval_loader = self._build_eval_data()
        self.optimizer, self.scheduler = self._build_optimizer()
        self.pipeline = self._build_pipeline()
        self.data_iter: Iterator[dict[str, torch.Tensor]] = iter(self.loader)
        self.checkpointer = self._build_checkpointer()
        self._maybe_resume()
        self._build_metric_sinks()

    def _build_tokenizer(self) -> Any:
        from meshforge.data.tokenizer import build_tokenizer, extension_options

        model_cfg = self.cfg.model
        path = model_cfg.tokenizer_name_or_path or model_cfg.model_name_or_path
        if not path:
            raise ValueError(
                "model.tokenizer_name_or_path: no tokenizer given (a local Hugging Face tokenizer folder, "
                "e.g. meshforge://assets/tokenizer)"
            )
        return build_tokenizer(
            str(path),
            use_fast=bool(model_cfg.use_fast_tokenizer),
            trust_remote_code=bool(model_cfg.trust_remote_code),
            **extension_options(model_cfg),
            log=self.log,
        )

    def _build_model(self) -> nn.Module:
        from meshforge.checkpoint.hf import load_hf_weights, resolve_model_source
        from meshforge.models.generic import GenericFamily
        from meshforge.models.materialize import materialize_and_init
        from meshforge.models.vocab import init_new_rows, vocab_plan
        from meshforge.parallel.parallelize import parallelize_model

        model_cfg = self.cfg.model
        # With model.model_name_or_path, config.json gives the options (and the family when the
        # section names none); passthrough model: keys override it, each override logged.
        source = resolve_model_source(model_cfg, log=self.log)
        family, options = source.family, source.options
        self.family = family
        # Added tokens (model.add_tokens, ...) may grow the vocabulary: the model is built with the
        # new size and the checkpoint's rows load into the first rows (models/vocab.py).
        self.vocab_plan = vocab_plan(
            self.tokenizer,
            _model_vocab_size(family, options),
            resize_vocab=bool(model_cfg.resize_vocab),
            log=self.log,
        )
        options = self.vocab_plan.model_options(options)
        load_hf = source.hf_dir is not None and not bool(model_cfg.train_from_scratch)
        params_dtype = parse_dtype(getattr(model_cfg, "params_dtype", None), key="model.params_dtype")
        compute_dtype = parse_dtype(model_cfg.compute_dtype, key="model.compute_dtype", default=params_dtype)
        self.compute_dtype = compute_dtype
        with torch.device("meta"):
            model = family.build(options)
        model.to(dtype=params_dtype)
        self.kernel_options = self._configure_kernels(model, family.name, compute_dtype)
        self._check_model_fits_data(getattr(model, "config", None))
        self.aux_coef = self._router_aux_coef(getattr(model, "config", None))
        self._aux_loss_enabled = self.aux_coef != 0.0 and callable(getattr(model, "aux_loss", None))
        self._check_parallel_support(family)
        parallel = parallelize_model(
            model,
            family="generic" if isinstance(family, GenericFamily) else family.name,
            dims=self.dims,
            mesh=self.mesh,
            parallelism=self.cfg.parallelism,
            param_dtype=params_dtype,
            compute_dtype=compute_dtype,
            compile_blocks=bool(self.kernel_options.compile),
            apply_compile=apply_compile,
        )
        model = parallel.model
        if self.cfg.parallelism.cpu_offload and self.device.type == "cpu":
            self.log("parallelism.cpu_offload: no effect on cpu (the parameters already live in host memory)")
        self.pipeline_split = parallel.pipeline_split
        self.fsdp = parallel.fsdp
        self._ignored_params = bool(self.cfg.parallelism.ignored_modules)
        if self._ignored_params and not self.fsdp:
            self.log("parallelism.ignored_modules: no effect without FSDP (nothing is sharded)")
        # Loaded weights overwrite every parameter, so skip drawing random ones first.
        init_fn = _no_init if load_hf else model.init_full_parameter_
        materialize_and_init(model, device=self.device, seed=int(self.cfg.training.seed), init_fn=init_fn)
        if load_hf:
            load_hf_weights(
                model,
                family,
                source.hf_dir,
                log=self.log,
                vocab_plan=self.vocab_plan,
                partial=self.pipeline_split is not None,
                aliases=self._tied_aliases(),
            )
        elif source.hf_dir is not None:
            self.log(f"model: random init (model.train_from_scratch); config from {source.hf_dir}")
        if self.vocab_plan.resized:
            init_new_rows(
                model,
                self.vocab_plan,
                self.tokenizer,
                str(model_cfg.init_special_tokens),
                int(self.cfg.training.seed),
                log=self.log,
            )
        num_params = sum(p.numel() for p in model.parameters())
        self.log(
            f"model: {family.name} with {num_params / 1e6:.2f}M parameters ({params_dtype} weights, "
            f"{compute_dtype} compute{self._sharding_note()})"
        )
        self.num_params = num_params
        return model

    def _configure_kernels(self, model: nn.Module, family: str, compute_dtype: torch.dtype) -> KernelOptions:
        """Resolve the `kernels` section for this device and hand it to the model (errors name the key)."""
        options = resolve_kernel_options(self.cfg.kernels, device=self.device, compute_dtype=compute_dtype)
        configure_model_kernels(model, options, family=family)
        on = [
            *(key for key, value in options.model_switches().items() if value),
            *(["compile"] if options.compile else []),
            *([f"chunk_loss_size={options.chunk_loss_size}"] if options.chunk_loss_size else []),
        ]
        if on:
            self.log(f"kernels: {', '.join(on)}")
        return options

    def _sharding_note(self) -> str:
        d = self.dims
        parts = []
        if d.pp > 1:
            stages = ", ".join(str(s) for s in getattr(self.pipeline_split, "stage_ids", []) or [])
            parts.append(
                f"pipeline stage(s) {stages} of {d.pp * int(self.cfg.parallelism.pipeline_parallel_interleave_num)}"
            )
        if d.tp > 1:
            parts.append(f"TP+SP over {d.tp} ranks")
        if d.ep > 1:
            shards = f"expert-FSDP over {d.expert_shard}" + (
                f" x {d.expert_replicas} replicas" if d.expert_replicas > 1 else ""
            )
            parts.append(f"experts over {d.ep} ranks ({shards})")
        if d.cp > 1:
            parts.append(f"CP ({self.cfg.parallelism.cp_method()}) over {d.cp} ranks")
        if self.fsdp:
            if d.dense_replicas > 1:
                parts.append(f"HSDP: {d.dense_replicas} replicas x FSDP over {d.dense_shard_size} ranks")
            else:
                parts.append(f"FSDP over {d.fsdp_size} ranks")
        return "".join(f", {p}" for p in parts)

    def _check_parallel_support(self, family: Any) -> None:
        """Refuse combinations of parallel degrees and trainer features that are not built yet."""
        d = self.dims
        if d.pp > 1 and self.cfg.checkpoint.save_hf_weights and not self.cfg.checkpoint.enable_save:
            # The stages hold different layers: the export reads the final checkpoint back whole.
            raise ValueError(
                "checkpoint.save_hf_weights: with parallelism.pipeline_parallel > 1 the Hugging Face "
                "export is written from the final checkpoint; set checkpoint.enable_save: true"
            )

    def _router_aux_coef(self, model_config: Any) -> float:
        """`training.router_aux_loss_coef` when the config sets it, else the model's own value."""
        training = self.cfg.training
        if "router_aux_loss_coef" in training.model_fields_set:
            return float(training.router_aux_loss_coef)
        return float(getattr(model_config, "router_aux_loss_coef", 0.0) or 0.0)

    def _check_model_fits_data(self, model_config: Any) -> None:
        """Refuse a tokenizer bigger than the embedding, or samples longer than the positions."""
        vocab = getattr(model_config, "vocab_size", None)
        if vocab is not None and len(self.tokenizer) > int(vocab):
            raise ValueError(
                f"model.vocab_size: {vocab} is smaller than the tokenizer's {len(self.tokenizer)} tokens"
            )
        max_pos = getattr(model_config, "max_position_embeddings", None)
        seq = self.cfg.train_dataset.seq_length()
        if max_pos is not None and seq is not None and int(seq) > int(max_pos):
            raise ValueError(
                f"model.max_position_embeddings: {max_pos} is shorter than the data's sequence length {seq}; "
                "raise it or shorten the samples"
            )

    def _build_optimizer(self) -> tuple[torch.optim.Optimizer, Any]:
        from meshforge.optim.build import build_optimizer
        from meshforge.optim.schedulers import build_lr_scheduler

        opt = self.cfg.optimizer
        sched = self.cfg.lr_scheduler
        optimizer = build_optimizer(
            self.model.named_parameters(),
            type=opt.type,
            learning_rate=float(sched.learning_rate),
            betas=tuple(opt.betas),
            eps=float(opt.eps),
            weight_decay=float(opt.weight_decay),
            weight_decay_include=opt.weight_decay_include,
            weight_decay_exclude=opt.weight_decay_exclude,
            options=dict(opt.model_extra or {}),
        )
        scheduler = build_lr_scheduler(
            optimizer,
            type=sched.type,
            learning_rate=float(sched.learning_rate),
            total_steps=self.total_steps,
            options=dict(sched.model_extra or {}),
        )
        return optimizer, scheduler

    def _build_pipeline(self) -> Any:
        """The pipeline schedule over this rank's stages (pp > 1), built on the materialised model."""
        if self.pipeline_split is None:
            return None
        from meshforge.parallel.pipeline import build_pipeline

        return build_pipeline(
            self.pipeline_split,
            self.model,
            self.mesh.view("pp"),
            device=self.device,
            n_microbatches=self.plan.grad_accum_steps,
            schedule=str(self.cfg.parallelism.pipeline_parallel_schedule),
            dxdw_split=bool(self.cfg.parallelism.pipeline_parallel_enable_dxdw_split),
            # The last stage adds the router aux loss from totals carried through the stages.
            aux_coef=self.aux_coef if self._aux_loss_enabled else 0.0,
            chunk_loss_size=self.kernel_options.chunk_loss_size,
        )

    def _epochs(self) -> float | None:
        """`training.epochs`: when set it decides the run length and `training.steps` is not used.

        (The MindSpeed importer already applies HF's rule that a positive `max_steps` wins over
        `num_train_epochs`, by not setting `epochs` then.)
        """
        return None if self.cfg.training.epochs is None else float(self.cfg.training.epochs)

    def _build_data(self) -> Any:
        from meshforge.data.build import LoaderContext, build_train_loader

        batch_mesh = self.mesh.view("batch")
        # One context for the train and the eval loader: SFT data is prepared once for both.
        self.loader_context = LoaderContext(
            tokenizer=self.tokenizer,
            local_batch_size=self.plan.local_batch_size,
            dp_rank=batch_mesh.get_local_rank(),
            dp_size=self.dims.dp,
            global_batch_size=self.plan.global_batch_size,
            seed=int(self.cfg.training.seed),
            # Megatron-format data sizes its sample index as steps x global batch, as Megatron does.
            total_steps=int(self.cfg.training.steps),
            epochs=self._epochs(),
            log=self.log,
        )
        return build_train_loader(self.cfg.train_dataset, self.loader_context)

    def _resolve_total_steps(self) -> int:
        """`training.steps`, or the steps that `training.epochs` passes over the data take."""
        training = self.cfg.training
        if training.epochs is None:
            return int(training.steps)
        steps = int(self.loader.total_steps)
        if "steps" in training.model_fields_set and int(training.steps) != steps:
            self.log(
                f"training.epochs {training.epochs:g} sets the run to {steps} steps (training.steps not used)"
            )
        return steps

    def _build_eval_data(self) -> Any:
        """The validation loader (val_size, eval_dataset, Megatron split), or None without one."""
        from meshforge.data.build import build_eval_loader

        interval = self.cfg.training.eval_interval
        loader = build_eval_loader(self.cfg.train_dataset, self.loader_context)
        if loader is None and interval is not None:
            raise ValueError(
                "training.eval_interval: there is no validation data: set train_dataset.val_size or "
                "train_dataset.eval_dataset (SFT), or a Megatron split with a validation part "
                "(e.g. split: '98,2,0')"
            )
        if loader is not None:
            when = f"every {interval} steps and at the end" if interval else "at the end of training"
            self.log(f"evaluation: {when} (training.eval_interval)")
        return loader

    def _build_checkpointer(self) -> CheckpointManager:
        ckpt = self.cfg.checkpoint
        save_dir = resolve_path(ckpt.save_path) if ckpt.save_path else self.output_dir / "checkpoints"
        return CheckpointManager(
            save_dir=save_dir,
            prefix=ckpt.prefix,
            interval=int(ckpt.save_interleaved_steps),
            keep=int(ckpt.save_max),
            enabled=bool(ckpt.enable_save),
            save_optimizer=not bool(ckpt.no_save_optim),
            rank=self.dist.rank,
            async_save=bool(ckpt.async_save),
            log=self.log,
        )

    def _maybe_resume(self) -> None:
        from meshforge.checkpoint.hf import is_hf_dir, load_hf_weights

        ckpt = self.cfg.checkpoint
        if not ckpt.load_path:
            return
        load_path = resolve_path(ckpt.load_path)
        if is_hf_dir(load_path):
            if not ckpt.no_load_optim:
                raise ValueError(
                    f"checkpoint.load_path: {load_path} is a Hugging Face checkpoint; resuming optimizer "
                    "state from it is not possible: set checkpoint.no_load_optim: true to load its weights"
                )
            load_hf_weights(
                self.model,
                self.family,
                load_path,
                log=self.log,
                vocab_plan=self.vocab_plan,
                partial=self.pipeline_split is not None,
                aliases=self._tied_aliases(),
            )
            self.log("checkpoint: starting at step 0 with the Hugging Face weights (no_load_optim)")
            return
        loaded = self.checkpointer.load(
            load_path,
            self.model,
            self.optimizer,
            load_optimizer=not bool(ckpt.no_load_optim),
            tied_aliases=self._tied_aliases(),
        )
        if not loaded.optimizer_loaded:
            self.log(f"checkpoint: loaded weights from {loaded.path} (no_load_optim: starting at step 0)")
            return
        state = loaded.trainer_state
        self.step = int(state["step"])
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["data"])
        self.data_iter = iter(self.loader)
        if loaded.rng_state is not None:
            set_rng_state(loaded.rng_state)
        else:
            self.log(f"warning: {loaded.path} has no RNG state for rank {self.dist.rank}; RNGs start fresh")
        self.log(f"checkpoint: resumed from {loaded.path} at step {self.step}")

    def _tied_aliases(self) -> dict[str, str]:
        """Tied-weight copies this rank holds apart from their source (pipeline last stage)."""
        copies = getattr(self.pipeline_split, "tied_copies", ()) or ()
        return {name: "model.embed_tokens.weight" for name in copies}

    def _build_metric_sinks(self) -> None:
        self.jsonl: JsonlMetrics | None = None
        self.tensorboard: TensorBoardMetrics | None = None
        self.console: ConsoleProgress | None = None
        if not self.dist.is_main:
            return
        self.console = ConsoleProgress(
            total=self.total_steps,
            start=self.step,
            interval=int(getattr(self.cfg.training, "log_interval", 1) or 1),
            emit=self.log,
            live=ConsoleProgress.wanted(self.dist.is_main),
        )
        self.jsonl = JsonlMetrics(self.output_dir / "metrics.jsonl", resume_step=self.step)
        tb = self.cfg.monitor.tensorboard
        if tb.output_dir:
            self.tensorboard = TensorBoardMetrics(
                resolve_path(tb.output_dir), log_interval=int(tb.log_interval), queue_size=int(tb.queue_size)
            )

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
        with self._loss_context():
            objective.backward()
        return _plain(loss_sum).detach()

    def _loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward one batch and return its summed token cross-entropy (the training and eval loss)."""
        inputs = {k: batch[k] for k in ("position_ids", "segment_ids", *self._cp_model_kwargs) if k in batch}
        autocast = self.compute_dtype != torch.float32 and not self.fsdp
        chunk = self.kernel_options.chunk_loss_size
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=autocast):
            if chunk is not None:
                # Read lm_head.weight after the forward: under FSDP the root's parameters are
                # unsharded by then (the root keeps them until backward).
                hidden = self.model(batch["input_ids"], return_hidden=True, **inputs)
                return chunked_cross_entropy_sum(
                    hidden, self.model.lm_head.weight, batch["labels"], chunk_size=chunk
                )
            logits = self.model(batch["input_ids"], **inputs)
        with self._loss_context():
            return cross_entropy_sum(logits, batch["labels"])

    def _loss_context(self) -> Any:
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
            float(self.cfg.training.max_norm),
            reduce_group=self.mesh.view("pp").get_group() if self.dims.pp > 1 else None,
            uncounted=uncounted,
        )

    def _norm_parameters(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Parameters whose gradients count in the global norm, and copies that are only clipped.

        Under pipeline parallelism a tied `lm_head.weight` on the last stage is a copy of the
        first stage's embedding with the same (summed) gradient: count it once.
        """
        params = dict(self.model.named_parameters())
        copies = set(getattr(self.pipeline_split, "tied_copies", ()) or ())
        counted = [p for name, p in params.items() if name not in copies]
        return counted, [p for name, p in params.items() if name in copies]

    def log_step(self, record: dict[str, Any]) -> None:
        """Write one step's metrics to every sink (rank 0 only)."""
        if self.jsonl is not None:
            self.jsonl.write(record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        if self.console is not None:
            self.console.update(record)

    # ----------------------------------------------------------------------------- loop
    def train_step(self) -> dict[str, Any]:
        """One optimizer step over `grad_accum_steps` micro-batches."""
        micro = [self._to_device(next(self.data_iter)) for _ in range(self.plan.grad_accum_steps)]
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
        if self.pipeline is not None:
            # The schedule runs forward and backward of every micro-batch over the stages and
            # returns the CE sum on every pipeline rank.
            loss_sum = self.pipeline.step(micro, normalizer)
            if self._aux_loss_enabled:
                self._aux_sum = self._aux_sum + self.pipeline.aux_sum
        else:
            loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
            for mb in micro:
                loss_sum += self.forward_backward(mb, normalizer)
        if self.fsdp and self._ignored_params:
            from meshforge.parallel.fsdp import sync_ignored_grads

            # Parameters FSDP leaves alone (parallelism.ignored_modules): sum their gradients here.
            sync_ignored_grads(self.model, loss_group)
        loss = dist_utils.all_reduce_sum(loss_sum / normalizer, loss_group)
        extra: dict[str, float] = {}
        if self._aux_loss_enabled:
            extra["aux_loss"] = float(dist_utils.all_reduce_sum(self._aux_sum, loss_group))
        grad_norm = self.clip_grads()
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "loss": float(loss),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens": step_tokens,
            "valid_tokens": int(global_tokens.item()),
            **extra,
        }

    def _loss_normalizer(self, local_tokens: int, global_tokens: torch.Tensor) -> torch.Tensor:
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
        try:
            while self.step < total:
                run_tokens += self._run_one_step(total, start_time, losses)
            # A background save must be on disk (and marked complete) before the run ends. Not
            # on error paths: a failed peer would never reach the barrier inside.
            self.checkpointer.finalize()
            if self.cfg.checkpoint.save_hf_weights:
                self._hf_export = self.export_hf(self.output_dir / "hf")
        finally:
            self.close()
        wall = time.perf_counter() - start_time
        return TrainSummary(
            steps=self.step - start_step,
            final_loss=losses[-1] if losses else float("nan"),
            tokens_per_s=run_tokens / wall if wall > 0 else 0.0,
            output_dir=self.output_dir,
            last_checkpoint=self._last_checkpoint,
            losses=losses,
            hf_export=self._hf_export,
        )

    def export_hf(self, out_dir: Path) -> Path:
        """Write the current weights, config and tokenizer as a HF folder (collective)."""
        from meshforge.checkpoint.hf import save_hf

        if self.pipeline_split is not None:
            return self._export_hf_from_checkpoint(out_dir)
        save_hf(self.model, self.family, out_dir, tokenizer=self.tokenizer if self.dist.is_main else None)
        self.log(f"checkpoint: exported Hugging Face weights to {out_dir} (checkpoint.save_hf_weights)")
        return out_dir

    def _export_hf_from_checkpoint(self, out_dir: Path) -> Path:
        """HF export of a pipeline run: rank 0 reads the final checkpoint whole; the others wait.

        Each stage holds only its own layers, so no rank can gather the model from memory; the
        checkpoint saved at the last step (always, when saving is on) holds all of it.
        """
        from meshforge.checkpoint.convert import dcp_to_hf

        if self._last_checkpoint is None:
            raise RuntimeError("checkpoint.save_hf_weights: no checkpoint was saved to export from")
        if self.dist.is_main:
            dcp_to_hf(
                self._last_checkpoint,
                out_dir,
                config_path=self.output_dir / "config.yaml",
                log=self.log,
            )
        dist_utils.barrier()
        self.log(f"checkpoint: exported Hugging Face weights to {out_dir} (checkpoint.save_hf_weights)")
        return out_dir

    def _run_one_step(self, total: int, start_time: float, losses: list[float]) -> int:
        """Train, record, log and maybe save one step; return the tokens it processed."""
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
        if not math.isfinite(metrics["loss"]):
            raise FloatingPointError(
                f"step {self.step}: loss is {metrics['loss']} (grad norm {metrics['grad_norm']}); "
                "lower lr_scheduler.learning_rate or check the data"
            )
        record = {
            "step": self.step,
            **metrics,
            "tokens_per_s": metrics["tokens"] / max(elapsed, 1e-9),
            "tokens_seen": self.tokens_seen,
            "elapsed_s": time.perf_counter() - start_time,
            "memory_bytes": peak_memory_bytes(self.device),
        }
        losses.append(metrics["loss"])
        if self._eval_due(total):
            record.update(self.evaluate())
            self.log(
                f"eval step {self.step}: eval_loss {record['eval_loss']:.4f} over {int(record['eval_tokens']):,} tokens"
            )
        self.log_step(record)
        if self.checkpointer.should_save(self.step, total):
            self._save()
        return int(metrics["tokens"])

    def _eval_due(self, total: int) -> bool:
        if self.eval_loader is None:
            return False
        interval = self.cfg.training.eval_interval
        return self.step == total or (interval is not None and self.step % int(interval) == 0)

    def evaluate(self) -> dict[str, float]:
        """Validation loss (global valid-token mean CE) over the whole validation loader."""
        from meshforge.evaluation import evaluate

        self.model.eval()
        try:
            if self.pipeline is not None:
                return self._evaluate_pipeline()
            return evaluate(
                self._eval_forward,
                self.eval_loader,
                device=self.device,
                loss_group=self.mesh.view("loss").get_group(),
                max_batches=self.cfg.training.eval_iters,
            )
        finally:
            self.model.train()
            # A forward without backward leaves FSDP's root unsharded; the next training forward
            # must gather the weights the optimizer updates, so reshard now.
            _reshard_fsdp(self.model)

    def _evaluate_pipeline(self) -> dict[str, float]:
        """Validation loss through the pipeline schedule, `grad_accum_steps` batches per call.

        The schedule was built for that many micro-batches, so the last group is filled up with
        copies whose labels are all ignored (they add no loss and no tokens).
        """
        size = self.plan.grad_accum_steps
        limit = self.cfg.training.eval_iters
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        group: list[dict[str, torch.Tensor]] = []

        def flush() -> None:
            tokens = sum(int(count_valid_tokens(mb["labels"])) for mb in group)
            while len(group) < size:
                filler = {k: v.clone() for k, v in group[0].items()}
                filler["labels"].fill_(-100)
                group.append(filler)
            with torch.no_grad():
                totals[0] += self.pipeline.evaluate(group).to(torch.float64)
            totals[1] += tokens
            group.clear()

        for index, batch in enumerate(self.eval_loader):
            if limit is not None and index >= int(limit):
                break
            group.append(self._to_device(batch))
            if len(group) == size:
                flush()
        if group:
            flush()
        totals = dist_utils.all_reduce_sum(totals, self.mesh.view("loss").get_group())
        loss_sum, tokens = (float(v) for v in totals.cpu())
        return {"eval_loss": loss_sum / tokens if tokens > 0 else math.nan, "eval_tokens": float(int(tokens))}

    def _eval_forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """CE sum and valid-token count of one validation batch (sharded for CP first)."""
        if self.dims.cp > 1:
            batch = self._shard_for_cp(batch)
        loss_sum = self._loss_sum(batch)
        return _plain(loss_sum).detach(), count_valid_tokens(batch["labels"])

    def _save(self) -> None:
        trainer_state = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "scheduler": self.scheduler.state_dict(),
            "data": self.loader.state_dict(),
            "world_size": self.dist.world_size,
            "global_batch_size": self.plan.global_batch_size,
        }
        self._last_checkpoint = self.checkpointer.save(
            self.step, self.model, self.optimizer, trainer_state, rng_state()
        )
        how = "started saving" if self.checkpointer.async_save else "saved"
        self.log(f"checkpoint: {how} step {self.step} to {self._last_checkpoint}")

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
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def close(self) -> None:
        if self.console is not None:
            self.console.close()
            self.console = None
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
