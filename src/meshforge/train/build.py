"""The trainer's build phase: tokenizer, model, optimizer, data, pipeline, checkpointer, sinks.

`TrainerBuild` is the half of `Trainer` that turns the validated config into the objects the
loop runs; each `_build_*` method reads its own section and calls its package's factory once, so
a change of a factory's signature touches one call here. The order is `Trainer.setup`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.nn as nn

from meshforge.checkpoint.manager import CheckpointManager
from meshforge.loss.mtp import mtp_factor
from meshforge.memory.apply import ActivationMemory, ActivationSettings
from meshforge.models.common.kernels import (
    KernelOptions,
    apply_compile,
    configure_model_kernels,
    resolve_kernel_options,
    supports_hidden_output,
)
from meshforge.monitor.console import ConsoleProgress
from meshforge.monitor.metrics import JsonlMetrics, TensorBoardMetrics
from meshforge.utils.dtype import parse_dtype
from meshforge.utils.resources import resolve_path
from meshforge.utils.seed import set_rng_state

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.config import TrainConfig
    from meshforge.data.loader import StatefulLoader, StreamLoader
    from meshforge.data.rampup import BatchRampUp
    from meshforge.lora.apply import LoraApplied, LoraSettings
    from meshforge.loss.lm import LMLoss
    from meshforge.models.common.compile import RunLength
    from meshforge.models.materialize import InitFn
    from meshforge.models.registry import FamilySpec
    from meshforge.models.vocab import VocabPlan
    from meshforge.optim.grad_accum import GradAccumulation
    from meshforge.parallel.dims import ParallelDims, ParallelMesh
    from meshforge.parallel.float8 import QuantPlan
    from meshforge.parallel.pipeline import Pipeline, PipelineSplit
    from meshforge.train.batches import BatchPlan
    from meshforge.utils.distributed import DistInfo

Batch = dict[str, torch.Tensor]


def _model_vocab_size(family: FamilySpec, options: dict[str, object]) -> int:
    """The embedding rows the model would have before any tokenizer extension."""
    return int(family.parse_options(options).vocab_size)


def _output_vocab(model: nn.Module) -> int | None:
    """Rows of the model's output projection (`lm_head`), or None without one."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else None


def _no_init(fqn: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    """Leave a parameter uninitialised: weights loaded right after overwrite it."""


class TrainerBuild:
    """Builds what `Trainer` runs; the attributes below are set by `Trainer.setup` in this order."""

    cfg: TrainConfig
    log: Callable[[str], None]
    dist: DistInfo
    device: torch.device
    dims: ParallelDims
    mesh: ParallelMesh
    plan: BatchPlan
    output_dir: Path
    tokenizer: PreTrainedTokenizerBase
    family: FamilySpec
    vocab_plan: VocabPlan
    compute_dtype: torch.dtype
    params_dtype: torch.dtype
    quant: QuantPlan | None
    rampup: BatchRampUp | None
    flops_per_token: float | None
    peak_flops: float | None
    kernel_options: KernelOptions
    lm_loss: LMLoss
    aux_coef: float
    pipeline_split: PipelineSplit | None
    fsdp: bool
    activation_memory: ActivationMemory | None
    lora: LoraApplied | None
    num_params: int
    model: nn.Module
    loader: StatefulLoader | StreamLoader
    total_steps: int
    eval_loader: Iterable[Batch] | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    pipeline: Pipeline | None
    data_iter: Iterator[Batch]
    checkpointer: CheckpointManager
    step: int
    tokens_seen: int
    jsonl: JsonlMetrics | None
    tensorboard: TensorBoardMetrics | None
    console: ConsoleProgress | None
    _aux_loss_enabled: bool
    mtp_coef: float
    _ignored_params: bool

    def _build_tokenizer(self) -> PreTrainedTokenizerBase:
        from meshforge.data.tokenizer import build_tokenizer, extension_options

        model_cfg = self.cfg.model
        path = model_cfg.tokenizer_name_or_path or model_cfg.model_name_or_path
        if not path:
            raise ValueError(
                "model.tokenizer_name_or_path: no tokenizer given (a local Hugging Face tokenizer folder, "
                "e.g. meshforge://assets/tokenizer)"
            )
        return build_tokenizer(
            path,
            use_fast=model_cfg.use_fast_tokenizer,
            trust_remote_code=model_cfg.trust_remote_code,
            **extension_options(model_cfg),
            log=self.log,
        )

    def _build_model(self) -> nn.Module:
        from meshforge.checkpoint.hf import load_hf_weights
        from meshforge.checkpoint.source import resolve_model_source
        from meshforge.data.tokenizer import tokenizer_extension
        from meshforge.lora.apply import with_adapter_init
        from meshforge.lora.layer import adapters_detached
        from meshforge.lora.settings import lora_settings
        from meshforge.models.generic import GenericFamily
        from meshforge.models.materialize import materialize_and_init
        from meshforge.models.vocab import init_new_rows, vocab_plan
        from meshforge.monitor.throughput import peak_flops
        from meshforge.parallel.float8 import quant_settings
        from meshforge.parallel.parallelize import parallelize_model

        model_cfg = self.cfg.model
        seed = self.cfg.training.seed
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
            resize_vocab=model_cfg.resize_vocab,
            added=tokenizer_extension(self.tokenizer),
            log=self.log,
        )
        options = self.vocab_plan.model_options(options)
        load_hf = source.hf_dir is not None and not model_cfg.train_from_scratch
        params_dtype = parse_dtype(model_cfg.params_dtype, key="model.params_dtype")
        compute_dtype = parse_dtype(model_cfg.compute_dtype, key="model.compute_dtype", default=params_dtype)
        self.compute_dtype = compute_dtype
        self.params_dtype = params_dtype
        with torch.device("meta"):
            model = family.build(options)
        model.to(dtype=params_dtype)
        run = self._run_length(model)  # the FLOPs of a token, counted once for compile and throughput
        self.kernel_options = self._configure_kernels(model, family.name, compute_dtype, run)
        model_config = getattr(model, "config", None)
        self._check_model_fits_data(model_config)
        self.flops_per_token = self._flops_per_token(run.flops_per_token)
        self.peak_flops = peak_flops(self.device, compute_dtype) if self.flops_per_token is not None else None
        self.aux_coef = self._router_aux_coef(model_config)
        self._aux_loss_enabled = self.aux_coef != 0.0 and callable(getattr(model, "aux_loss", None))
        self.mtp_coef = mtp_factor(
            model,
            self.cfg.training.mtp_loss_scaling_factor,
            family=family.name,
            context_parallel=self.dims.cp,
        )
        self._check_parallel_support()
        lora = lora_settings(self.cfg.lora_config) if self.cfg.lora_config is not None else None
        parallel = parallelize_model(
            model,
            family="generic" if isinstance(family, GenericFamily) else family.name,
            dims=self.dims,
            mesh=self.mesh,
            parallelism=self.cfg.parallelism,
            param_dtype=params_dtype,
            compute_dtype=compute_dtype,
            compile_blocks=self.kernel_options.compile,
            apply_compile=functools.partial(
                apply_compile, backend=self.kernel_options.compile_backend, warn=self.log
            ),
            activation=ActivationSettings(self.cfg.recompute, self.cfg.recompute_comm, self.cfg.swap),
            lora=lora,
            reduce_dtype=self._reduce_dtype(params_dtype, compute_dtype),
            quant=quant_settings(model_cfg),
            device=self.device,
        )
        model = parallel.model
        self.lora = parallel.lora
        if parallel.lora is not None:
            self.log(parallel.lora.summary())
        self.activation_memory = parallel.activation
        self.quant = parallel.quant
        if parallel.quant is not None:
            self.log(parallel.quant.summary())
            for note in parallel.quant.notes:
                self.log(f"warning: {note}")
        if parallel.activation is not None:
            self.log(parallel.activation.summary())
        self.pipeline_split = parallel.pipeline_split
        self.fsdp = parallel.fsdp
        self._ignored_params = bool(self.cfg.parallelism.ignored_modules)
        if self._ignored_params and not self.fsdp:
            self.log("parallelism.ignored_modules: no effect without FSDP (nothing is sharded)")
        # Loaded weights overwrite every parameter, so skip drawing random ones first.
        # Every family's model class (and the generic path's) defines init_full_parameter_.
        init_fn = _no_init if load_hf else cast("InitFn", model.init_full_parameter_)
        if lora is not None:
            init_fn = with_adapter_init(init_fn, lora)
        materialize_and_init(model, device=self.device, seed=seed, init_fn=init_fn)
        if load_hf and source.hf_dir is not None:
            # The Hugging Face folder holds the base model: the adapters stay out of its key check.
            with adapters_detached(model):
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
        self._lora_base: tuple[str, Path | None] | None = None
        if lora is not None and self.cfg.lora_config is not None:
            self._lora_base = (
                ("hf", source.hf_dir) if load_hf and source.hf_dir is not None else ("init", None)
            )
            self._load_adapter(model, lora, self.cfg.lora_config.adapter_path)
        if self.vocab_plan.resized:
            init_new_rows(
                model, self.vocab_plan, self.tokenizer, model_cfg.init_special_tokens, seed, log=self.log
            )
        num_params = sum(p.numel() for p in model.parameters())
        self.log(
            f"model: {family.name} with {num_params / 1e6:.2f}M parameters ({params_dtype} weights, "
            f"{compute_dtype} compute{self._sharding_note()})"
        )
        self.num_params = num_params
        return model

    def _reduce_dtype(self, params_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
        """FSDP's reduce dtype: `parallelism.reduce_dtype`, or the low-precision dtype with
        `optimizer.accumulate_allreduce_grads_in_fp32: false` (optim/grad_accum.py)."""
        from meshforge.optim.grad_accum import reduce_dtype_for

        configured = parse_dtype(self.cfg.parallelism.reduce_dtype, key="parallelism.reduce_dtype")
        return reduce_dtype_for(
            configured,
            fp32=self.cfg.optimizer.accumulate_allreduce_grads_in_fp32,
            params_dtype=params_dtype,
            compute_dtype=compute_dtype,
        )

    def _build_rampup(self) -> BatchRampUp | None:
        """`training.rampup_batch_size` over this run's data-parallel ranks (None: no ramp)."""
        from meshforge.data.rampup import build_rampup

        training = self.cfg.training
        rampup = build_rampup(
            training.rampup_batch_size,
            global_batch_size=training.global_batch_size,
            micro_samples=self.plan.data_parallel * self.plan.local_batch_size,
            pipeline_parallel=self.dims.pp,
            epochs=training.epochs is not None,
        )
        if rampup is not None:
            self.log(rampup.describe())
        return rampup

    def _build_grad_accumulation(self) -> GradAccumulation:
        from meshforge.optim.grad_accum import GradAccumulation

        accum = GradAccumulation(
            self.model.parameters(),
            fp32=self.cfg.optimizer.accumulate_allreduce_grads_in_fp32,
            params_dtype=self.params_dtype,
            compute_dtype=self.compute_dtype,
        )
        if accum.active:
            self.log(f"optimizer: {accum.describe()}")
        return accum

    def _configure_kernels(
        self, model: nn.Module, family: str, compute_dtype: torch.dtype, run: RunLength
    ) -> KernelOptions:
        """Resolve the `kernels` section for this device and hand it to the model (errors name the key)."""
        options = resolve_kernel_options(
            self.cfg.kernels,
            device=self.device,
            compute_dtype=compute_dtype,
            warn=self.log,
            vocab_size=_output_vocab(model),
            run=run,
            loss_parallel=self.dims.tp > 1 and self.cfg.parallelism.enable_loss_parallel,
            hidden_output=supports_hidden_output(model),
        )
        options = configure_model_kernels(model, options, family=family)
        self.lm_loss = options.lm_loss()
        on = [key for key, value in options.model_switches().items() if value]
        if on:
            self.log(f"kernels: {', '.join(on)}")
        self.log(f"{options.compile_reason}; loss: {self.lm_loss.describe()}")
        return options

    def _run_length(self, model: nn.Module) -> RunLength:
        """Steps and per-rank work of the run, for `kernels.compile: auto` on the CPU."""
        from meshforge.models.common.compile import RunLength
        from meshforge.monitor.throughput import model_flops_per_token

        seq = self.cfg.train_dataset.seq_length() or self.cfg.model.seq_length
        training = self.cfg.training
        if seq is None:
            return RunLength(None, 0, None)
        flops = model_flops_per_token(model, int(seq))
        if training.epochs is not None:
            return RunLength(None, 0, flops)
        tokens = self.plan.global_batch_size * int(seq) // max(1, self.dims.world_size)
        return RunLength(int(training.steps), tokens, flops)

    def _sharding_note(self) -> str:
        d = self.dims
        parts = []
        if d.pp > 1 and self.pipeline_split is not None:
            stages = ", ".join(str(s) for s in self.pipeline_split.stage_ids)
            parts.append(
                f"pipeline stage(s) {stages} of {d.pp * self.cfg.parallelism.pipeline_parallel_interleave_num}"
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

    def _check_parallel_support(self) -> None:
        """Refuse combinations of parallel degrees and trainer features that are not built yet."""
        ckpt = self.cfg.checkpoint
        if self.dims.pp > 1 and ckpt.save_hf_weights and not ckpt.enable_save:
            # The stages hold different layers: the export reads the final checkpoint back whole.
            raise ValueError(
                "checkpoint.save_hf_weights: with parallelism.pipeline_parallel > 1 the Hugging Face "
                "export is written from the final checkpoint; set checkpoint.enable_save: true"
            )

    def _router_aux_coef(self, model_config: object) -> float:
        """`training.router_aux_loss_coef` when the config sets it, else the model's own value.

        `model_config` is the family's options object (or a transformers config on the generic
        path); families without a router have no such field.
        """
        training = self.cfg.training
        if "router_aux_loss_coef" in training.model_fields_set:
            return training.router_aux_loss_coef
        return float(getattr(model_config, "router_aux_loss_coef", 0.0) or 0.0)

    def _flops_per_token(self, flops: float | None) -> float | None:
        """Model FLOPs of one token for `training.log_throughput` (counted on the whole model)."""
        if not self.cfg.training.log_throughput:
            return None
        if flops is None:
            raise ValueError(
                "training.log_throughput: the FLOPs of a token depend on the sequence length, which "
                "neither the data nor model.seq_length gives"
            )
        return flops

    def _check_model_fits_data(self, model_config: object) -> None:
        """Refuse a tokenizer bigger than the embedding, or samples longer than the positions."""
        vocab = getattr(model_config, "vocab_size", None)
        if vocab is not None and len(self.tokenizer) > vocab:
            raise ValueError(
                f"model.vocab_size: {vocab} is smaller than the tokenizer's {len(self.tokenizer)} tokens"
            )
        max_pos = getattr(model_config, "max_position_embeddings", None)
        seq = self.cfg.train_dataset.seq_length()
        if max_pos is not None and seq is not None and seq > max_pos:
            raise ValueError(
                f"model.max_position_embeddings: {max_pos} is shorter than the data's sequence length {seq}; "
                "raise it or shorten the samples"
            )

    def _build_optimizer(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        from meshforge.optim.build import build_optimizer
        from meshforge.optim.schedulers import build_lr_scheduler

        opt = self.cfg.optimizer
        sched = self.cfg.lr_scheduler
        optimizer = build_optimizer(
            self.model.named_parameters(),
            type=opt.type,
            learning_rate=sched.learning_rate,
            betas=tuple(opt.betas),
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            weight_decay_include=opt.weight_decay_include,
            weight_decay_exclude=opt.weight_decay_exclude,
            options=dict(opt.model_extra or {}),
        )
        hook = self.quant.after_optimizer_step if self.quant is not None else None
        if hook is not None:
            # model.fsdp_low_precision_all_gather_mode: all: every weight's float8 scale at once.
            model = self.model
            optimizer.register_step_post_hook(lambda *_args: hook(model))
        scheduler = build_lr_scheduler(
            optimizer,
            type=sched.type,
            learning_rate=sched.learning_rate,
            total_steps=self.total_steps,
            options=dict(sched.model_extra or {}),
            position=self.rampup.schedule_position if self.rampup is not None else None,
        )
        return optimizer, scheduler

    def _build_pipeline(self) -> Pipeline | None:
        """The pipeline schedule over this rank's stages (pp > 1), built on the materialised model."""
        if self.pipeline_split is None:
            return None
        from meshforge.parallel.pipeline import build_pipeline

        parallelism = self.cfg.parallelism
        return build_pipeline(
            self.pipeline_split,
            self.model,
            self.mesh.view("pp"),
            device=self.device,
            n_microbatches=self.plan.grad_accum_steps,
            schedule=parallelism.pipeline_parallel_schedule,
            dxdw_split=parallelism.pipeline_parallel_enable_dxdw_split,
            # The last stage adds the router aux loss from totals carried through the stages.
            aux_coef=self.aux_coef if self._aux_loss_enabled else 0.0,
            lm_loss=self.lm_loss,
            mtp_coef=self.mtp_coef,
        )

    def _build_data(self) -> StatefulLoader | StreamLoader:
        """The train loader; `training.epochs`, when set, decides the run length (see `_resolve_total_steps`).

        The MindSpeed importer already applies HF's rule that a positive `max_steps` wins over
        `num_train_epochs`, by not setting `epochs` then.
        """
        from meshforge.data.build import LoaderContext, build_train_loader

        training = self.cfg.training
        # One context for the train and the eval loader: SFT data is prepared once for both.
        self.loader_context = LoaderContext(
            tokenizer=self.tokenizer,
            local_batch_size=self.plan.local_batch_size,
            dp_rank=self.mesh.view("batch").get_local_rank(),
            dp_size=self.dims.dp,
            global_batch_size=self.plan.global_batch_size,
            seed=training.seed,
            # Megatron-format data sizes its sample index as steps x global batch, as Megatron does.
            total_steps=training.steps,
            epochs=training.epochs,
            log=self.log,
        )
        return build_train_loader(self.cfg.train_dataset, self.loader_context)

    def _resolve_total_steps(self) -> int:
        """`training.steps`, or the steps that `training.epochs` passes over the data take."""
        training = self.cfg.training
        if training.epochs is None:
            return training.steps
        steps = self.loader.total_steps
        if steps is None:
            raise RuntimeError("training.epochs: the train loader did not size the run (no total_steps)")
        if "steps" in training.model_fields_set and training.steps != steps:
            self.log(
                f"training.epochs {training.epochs:g} sets the run to {steps} steps (training.steps not used)"
            )
        return steps

    def _build_eval_data(self) -> Iterable[Batch] | None:
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
            interval=ckpt.save_interleaved_steps,
            keep=ckpt.save_max,
            enabled=ckpt.enable_save,
            save_optimizer=not ckpt.no_save_optim,
            rank=self.dist.rank,
            async_save=ckpt.async_save,
            log=self.log,
            lora_base=self._lora_base,
        )

    def _load_adapter(self, model: nn.Module, lora: LoraSettings, adapter_path: str) -> None:
        """Start the adapters from a PEFT adapter folder (`lora_config.adapter_path`), if one is named."""
        if not adapter_path:
            return
        from meshforge.lora.peft_io import load_peft_adapter

        load_peft_adapter(
            model,
            self.family,
            resolve_path(adapter_path),
            settings=lora,
            partial=self.pipeline_split is not None,
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
            from meshforge.lora.layer import adapters_detached

            with adapters_detached(self.model):
                load_hf_weights(
                    self.model,
                    self.family,
                    load_path,
                    log=self.log,
                    vocab_plan=self.vocab_plan,
                    partial=self.pipeline_split is not None,
                    aliases=self._tied_aliases(),
                )
            if self.checkpointer.lora_base is not None:
                self.checkpointer.lora_base = ("hf", load_path)
            self.log("checkpoint: starting at step 0 with the Hugging Face weights (no_load_optim)")
            return
        loaded = self.checkpointer.load(
            load_path,
            self.model,
            self.optimizer,
            load_optimizer=not ckpt.no_load_optim,
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
        copies = self.pipeline_split.tied_copies if self.pipeline_split is not None else ()
        return {name: "model.embed_tokens.weight" for name in copies}

    def _build_metric_sinks(self) -> None:
        self.jsonl = None
        self.tensorboard = None
        self.console = None
        if not self.dist.is_main:
            return
        self.console = ConsoleProgress(
            total=self.total_steps,
            start=self.step,
            interval=self.cfg.training.log_interval,
            emit=self.log,
            live=ConsoleProgress.wanted(self.dist.is_main),
        )
        self.jsonl = JsonlMetrics(self.output_dir / "metrics.jsonl", resume_step=self.step)
        tb = self.cfg.monitor.tensorboard
        if tb.output_dir or "tensorboard" in self.cfg.monitor.trackers():
            # `monitor.report_to: tensorboard` without a folder writes into the run folder.
            folder = resolve_path(tb.output_dir) if tb.output_dir else self.output_dir / "tensorboard"
            self.tensorboard = TensorBoardMetrics(
                folder, log_interval=tb.log_interval, queue_size=tb.queue_size
            )
