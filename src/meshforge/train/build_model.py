"""The model half of the build: tokenizer, then the model from its family's spec, parallelised,
materialised and loaded, and what was decided with it (dtypes, kernels, loss, coefficients).

`build_model` returns one `ModelParts`; every decision it takes is a small function of the
config sections and values it needs, called in the order the run logs them.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.nn as nn

from meshforge.loss.mtp import mtp_factor
from meshforge.memory.apply import ActivationSettings
from meshforge.models.common.kernels import (
    KernelOptions,
    apply_compile,
    configure_model_kernels,
    resolve_kernel_options,
    supports_hidden_output,
)
from meshforge.train.reward_head import (
    HEAD,
    attach_value_head,
    freeze_lm_head,
    init_std,
    value_head_detached,
    with_head_init,
)
from meshforge.train.run import ModelParts, tied_aliases
from meshforge.utils.dtype import parse_dtype
from meshforge.utils.resources import resolve_path

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PreTrainedTokenizerBase

    from meshforge.checkpoint.config import CheckpointConfig
    from meshforge.config import TrainConfig
    from meshforge.lora.apply import LoraSettings
    from meshforge.loss.lm import LMLoss
    from meshforge.models.common.compile import RunLength
    from meshforge.models.config import ModelConfig
    from meshforge.models.materialize import InitFn
    from meshforge.models.registry import FamilySpec
    from meshforge.optim.config import OptimizerConfig
    from meshforge.parallel.config import ParallelismConfig
    from meshforge.parallel.dims import ParallelDims
    from meshforge.parallel.pipeline import PipelineSplit
    from meshforge.train.config import TrainingConfig
    from meshforge.train.run import RunEnv


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


def build_tokenizer(model_cfg: ModelConfig, log: Callable[[str], None]) -> PreTrainedTokenizerBase:
    """The run's tokenizer from a local folder, with `model.add_tokens` and the like applied."""
    from meshforge.data.tokenizer import build_tokenizer as load_tokenizer
    from meshforge.data.tokenizer import extension_options

    path = model_cfg.tokenizer_name_or_path or model_cfg.model_name_or_path
    if not path:
        raise ValueError(
            "model.tokenizer_name_or_path: no tokenizer given (a local Hugging Face tokenizer folder, "
            "e.g. meshforge://assets/tokenizer)"
        )
    return load_tokenizer(
        path,
        use_fast=model_cfg.use_fast_tokenizer,
        trust_remote_code=model_cfg.trust_remote_code,
        **extension_options(model_cfg),
        log=log,
    )


def build_model(cfg: TrainConfig, env: RunEnv, tokenizer: PreTrainedTokenizerBase) -> ModelParts:
    """Build, parallelise, materialise and load the model; log what was decided on the way."""
    from meshforge.checkpoint.hf import load_hf_weights
    from meshforge.checkpoint.source import resolve_model_source
    from meshforge.data.tokenizer import tokenizer_extension
    from meshforge.lora.apply import with_adapter_init
    from meshforge.lora.layer import adapters_detached
    from meshforge.lora.settings import lora_settings
    from meshforge.models.materialize import materialize_and_init, materialize_fake
    from meshforge.models.vocab import init_new_rows, vocab_plan
    from meshforge.monitor.throughput import peak_flops
    from meshforge.parallel.float8 import quant_settings
    from meshforge.parallel.parallelize import parallelize_model

    log, dims = env.log, env.dims
    model_cfg = cfg.model
    seed = cfg.training.seed
    # With model.model_name_or_path, config.json gives the options (and the family when the
    # section names none); passthrough model: keys override it, each override logged.
    source = resolve_model_source(model_cfg, log=log)
    family, options = source.family, source.options
    # Added tokens (model.add_tokens, ...) may grow the vocabulary: the model is built with the
    # new size and the checkpoint's rows load into the first rows (models/vocab.py).
    vocab = vocab_plan(
        tokenizer,
        _model_vocab_size(family, options),
        resize_vocab=model_cfg.resize_vocab,
        added=tokenizer_extension(tokenizer),
        log=log,
    )
    options = vocab.model_options(options)
    load_hf = source.hf_dir is not None and not model_cfg.train_from_scratch
    params_dtype = parse_dtype(model_cfg.params_dtype, key="model.params_dtype")
    compute_dtype = parse_dtype(model_cfg.compute_dtype, key="model.compute_dtype", default=params_dtype)
    with torch.device("meta"):
        model = family.build(options)
    model.to(dtype=params_dtype)
    reward = cfg.training.stage == "rm"
    if reward:  # the value head of a reward model (train/reward_head.py), on the meta device too
        attach_value_head(model, tp_mesh=env.mesh.view("tp") if dims.tp > 1 else None)
        freeze_lm_head(model)
    seq = cfg.train_dataset.seq_length() or model_cfg.seq_length
    # The FLOPs of a token, counted once for the compile decision and the throughput log.
    run = _run_length(model, cfg.training, seq=seq, env=env, no_load_optim=cfg.checkpoint.no_load_optim)
    kernel_options, lm_loss = _configure_kernels(cfg, model, family.name, compute_dtype, env=env, run=run)
    model_config = getattr(model, "config", None)
    _check_model_fits_data(model_config, tokenizer, data_seq=cfg.train_dataset.seq_length())
    flops_per_token = _flops_per_token(run.flops_per_token, cfg.training)
    peak = peak_flops(env.device, compute_dtype) if flops_per_token is not None else None
    aux_coef = _router_aux_coef(cfg.training, model_config)
    aux_loss_enabled = aux_coef != 0.0 and callable(getattr(model, "aux_loss", None))
    mtp_coef = mtp_factor(
        model, cfg.training.mtp_loss_scaling_factor, family=family.name, context_parallel=dims.cp
    )
    _check_parallel_support(dims, cfg.checkpoint)
    lora = lora_settings(cfg.lora_config) if cfg.lora_config is not None else None
    if lora is not None and reward:
        lora = dataclasses.replace(lora, trainable_modules=(HEAD,))
    parallel = parallelize_model(
        model,
        family=family,
        dims=dims,
        mesh=env.mesh,
        parallelism=cfg.parallelism,
        param_dtype=params_dtype,
        compute_dtype=compute_dtype,
        compile_blocks=kernel_options.compile,
        apply_compile=functools.partial(
            apply_compile, backend=kernel_options.compile_backend, warn=log, log=log
        ),
        activation=ActivationSettings(cfg.recompute, cfg.recompute_comm, cfg.swap),
        lora=lora,
        reduce_dtype=_reduce_dtype(cfg.parallelism, cfg.optimizer, params_dtype, compute_dtype),
        quant=quant_settings(model_cfg),
        device=env.device,
    )
    model = parallel.model
    if parallel.lora is not None:
        log(parallel.lora.summary())
    if parallel.quant is not None:
        log(parallel.quant.summary())
        for note in parallel.quant.notes:
            log(f"warning: {note}")
    if parallel.activation is not None:
        log(parallel.activation.summary())
    split = parallel.pipeline_split
    ignored_params = bool(cfg.parallelism.ignored_modules)
    if ignored_params and not parallel.fsdp:
        log("parallelism.ignored_modules: no effect without FSDP (nothing is sharded)")
    # Loaded weights overwrite every parameter, so skip drawing random ones first.
    # Every family's model class (and the generic path's) defines init_full_parameter_.
    init_fn = _no_init if load_hf else cast("InitFn", model.init_full_parameter_)
    if lora is not None:
        init_fn = with_adapter_init(init_fn, lora)
    if reward:
        init_fn = with_head_init(init_fn, init_std(model))
    if env.fake_tensors is not None:
        # A dry run: fake storage of the right shapes, nothing drawn, loaded or resized.
        with env.fake_tensors:
            materialize_fake(model, device=env.device)
        log("model: fake tensors (dry run): no weights initialised or loaded")
        load_hf = False
    else:
        materialize_and_init(model, device=env.device, seed=seed, init_fn=init_fn)
    if load_hf and source.hf_dir is not None:
        # The Hugging Face folder holds the base model: the adapters stay out of its key check.
        with adapters_detached(model), value_head_detached(model):
            load_hf_weights(
                model,
                family,
                source.hf_dir,
                log=log,
                vocab_plan=vocab,
                partial=split is not None,
                aliases=tied_aliases(split),
            )
    elif source.hf_dir is not None:
        log(f"model: random init (model.train_from_scratch); config from {source.hf_dir}")
    lora_base: tuple[str, Path | None] | None = None
    if lora is not None and cfg.lora_config is not None:
        lora_base = ("hf", source.hf_dir) if load_hf and source.hf_dir is not None else ("init", None)
        if env.fake_tensors is None:
            _load_adapter(
                model, family, lora, cfg.lora_config.adapter_path, partial=split is not None, log=log
            )
    if vocab.resized and env.fake_tensors is None:
        init_new_rows(model, vocab, tokenizer, model_cfg.init_special_tokens, seed, log=log)
    num_params = sum(p.numel() for p in model.parameters())
    note = _sharding_note(dims, cfg.parallelism, split=split, fsdp=parallel.fsdp)
    log(
        f"model: {family.name} with {num_params / 1e6:.2f}M parameters ({params_dtype} weights, "
        f"{compute_dtype} compute{note})"
    )
    return ModelParts(
        module=model,
        family=family,
        tokenizer=tokenizer,
        vocab_plan=vocab,
        params_dtype=params_dtype,
        compute_dtype=compute_dtype,
        kernel_options=kernel_options,
        lm_loss=lm_loss,
        aux_coef=aux_coef,
        aux_loss_enabled=aux_loss_enabled,
        mtp_coef=mtp_coef,
        pipeline_split=split,
        fsdp=parallel.fsdp,
        ignored_params=ignored_params,
        activation_memory=parallel.activation,
        lora=parallel.lora,
        lora_base=lora_base,
        quant=parallel.quant,
        num_params=num_params,
        flops_per_token=flops_per_token,
        peak_flops=peak,
    )


def _reduce_dtype(
    parallelism: ParallelismConfig,
    optimizer: OptimizerConfig,
    params_dtype: torch.dtype,
    compute_dtype: torch.dtype,
) -> torch.dtype:
    """FSDP's reduce dtype: `parallelism.reduce_dtype`, or the low-precision dtype with
    `optimizer.accumulate_allreduce_grads_in_fp32: false` (optim/grad_accum.py)."""
    from meshforge.optim.grad_accum import reduce_dtype_for

    configured = parse_dtype(parallelism.reduce_dtype, key="parallelism.reduce_dtype")
    return reduce_dtype_for(
        configured,
        fp32=optimizer.accumulate_allreduce_grads_in_fp32,
        params_dtype=params_dtype,
        compute_dtype=compute_dtype,
    )


def _configure_kernels(
    cfg: TrainConfig,
    model: nn.Module,
    family: str,
    compute_dtype: torch.dtype,
    *,
    env: RunEnv,
    run: RunLength,
) -> tuple[KernelOptions, LMLoss]:
    """Resolve the `kernels` section for this device and hand it to the model (errors name the key)."""
    options = resolve_kernel_options(
        cfg.kernels,
        device=env.device,
        compute_dtype=compute_dtype,
        warn=env.log,
        vocab_size=_output_vocab(model),
        run=run,
        loss_parallel=env.dims.tp > 1 and cfg.parallelism.enable_loss_parallel,
        hidden_output=supports_hidden_output(model),
    )
    options = configure_model_kernels(model, options, family=family)
    lm_loss = options.lm_loss()
    on = [key for key, value in options.model_switches().items() if value]
    if on:
        env.log(f"kernels: {', '.join(on)}")
    env.log(f"{options.compile_reason}; loss: {lm_loss.describe()}")
    return options, lm_loss


def _run_length(
    model: nn.Module, training: TrainingConfig, *, seq: int | None, env: RunEnv, no_load_optim: bool
) -> RunLength:
    """Steps and per-rank work of the run, for `kernels.compile: auto` on the CPU."""
    from meshforge.models.common.compile import RunLength
    from meshforge.monitor.throughput import model_flops_per_token

    if seq is None:
        return RunLength(None, 0, None)
    flops = model_flops_per_token(model, int(seq))
    if training.epochs is not None:
        return RunLength(None, 0, flops)
    tokens = env.plan.global_batch_size * int(seq) // max(1, env.dims.world_size)
    left = max(0, int(training.steps) - _resume_step(env.load_path, no_load_optim=no_load_optim))
    return RunLength(left, tokens, flops)


def _resume_step(load_path: str, *, no_load_optim: bool) -> int:
    """The step a full resume of `load_path` starts at, read off its `trainer_state.json` (0 when
    the run starts fresh; a folder that cannot be read is `resume`'s to report)."""
    from meshforge.checkpoint.hf import is_hf_dir
    from meshforge.checkpoint.manager import read_trainer_state, resolve_load_path

    if not load_path or no_load_optim:
        return 0
    try:
        path = resolve_path(load_path)
        if is_hf_dir(path):
            return 0
        return int(read_trainer_state(resolve_load_path(path))["step"])
    except (OSError, ValueError):
        return 0


def _sharding_note(
    d: ParallelDims, parallelism: ParallelismConfig, *, split: PipelineSplit | None, fsdp: bool
) -> str:
    """How the model is spread over the ranks, for the model's log line (empty on one rank)."""
    parts = []
    if d.pp > 1 and split is not None:
        stages = ", ".join(str(s) for s in split.stage_ids)
        parts.append(f"pipeline stage(s) {stages} of {d.pp * parallelism.pipeline_parallel_interleave_num}")
    if d.tp > 1:
        parts.append(f"TP+SP over {d.tp} ranks")
    if d.ep > 1:
        shards = f"expert-FSDP over {d.expert_shard}" + (
            f" x {d.expert_replicas} replicas" if d.expert_replicas > 1 else ""
        )
        parts.append(f"experts over {d.ep} ranks ({shards})")
    if d.cp > 1:
        parts.append(f"CP ({parallelism.cp_method()}) over {d.cp} ranks")
    if fsdp:
        if d.dense_replicas > 1:
            parts.append(f"HSDP: {d.dense_replicas} replicas x FSDP over {d.dense_shard_size} ranks")
        else:
            parts.append(f"FSDP over {d.fsdp_size} ranks")
    return "".join(f", {p}" for p in parts)


def _check_parallel_support(dims: ParallelDims, ckpt: CheckpointConfig) -> None:
    """Refuse combinations of parallel degrees and trainer features that are not built yet."""
    if dims.pp > 1 and ckpt.save_hf_weights and not ckpt.enable_save:
        # The stages hold different layers: the export reads the final checkpoint back whole.
        raise ValueError(
            "checkpoint.save_hf_weights: with parallelism.pipeline_parallel > 1 the Hugging Face "
            "export is written from the final checkpoint; set checkpoint.enable_save: true"
        )


def _router_aux_coef(training: TrainingConfig, model_config: object) -> float:
    """`training.router_aux_loss_coef` when the config sets it, else the model's own value.

    `model_config` is the family's options object (or a transformers config on the generic
    path); families without a router have no such field.
    """
    if "router_aux_loss_coef" in training.model_fields_set:
        return training.router_aux_loss_coef
    return float(getattr(model_config, "router_aux_loss_coef", 0.0) or 0.0)


def _flops_per_token(flops: float | None, training: TrainingConfig) -> float | None:
    """Model FLOPs of one token for `training.log_throughput` (counted on the whole model)."""
    if not training.log_throughput:
        return None
    if flops is None:
        raise ValueError(
            "training.log_throughput: the FLOPs of a token depend on the sequence length, which "
            "neither the data nor model.seq_length gives"
        )
    return flops


def _check_model_fits_data(
    model_config: object, tokenizer: PreTrainedTokenizerBase, *, data_seq: int | None
) -> None:
    """Refuse a tokenizer bigger than the embedding, or samples longer than the positions."""
    vocab = getattr(model_config, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ValueError(f"model.vocab_size: {vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")
    max_pos = getattr(model_config, "max_position_embeddings", None)
    if max_pos is not None and data_seq is not None and data_seq > max_pos:
        raise ValueError(
            f"model.max_position_embeddings: {max_pos} is shorter than the data's sequence length {data_seq}; "
            "raise it or shorten the samples"
        )


def _load_adapter(
    model: nn.Module,
    family: FamilySpec,
    lora: LoraSettings,
    adapter_path: str,
    *,
    partial: bool,
    log: Callable[[str], None],
) -> None:
    """Start the adapters from a PEFT adapter folder (`lora_config.adapter_path`), if one is named."""
    if not adapter_path:
        return
    from meshforge.lora.peft_io import load_peft_adapter

    load_peft_adapter(model, family, resolve_path(adapter_path), settings=lora, partial=partial, log=log)
