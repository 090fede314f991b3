"""The build phase: from a validated config to one `Run` of built parts, in a fixed order.

`build_run` is the order (DESIGN.md "A run, step by step"): process group and mesh -> callbacks
-> tokenizer -> model (`build_model.py`) -> data -> optimizer and schedule -> pipeline ->
checkpointer (resume) -> metric sinks and watchers. Each step is a function of the config
sections and parts it needs and calls its package's factory once, so a change of a factory's
signature touches one call here; the watchers come last because they need the model, the mesh
and the resumed step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from meshforge.checkpoint.manager import CheckpointManager
from meshforge.config import dump_config
from meshforge.config.noops import noop_notes
from meshforge.monitor.console import ConsoleProgress
from meshforge.monitor.logger import MetricsLogger
from meshforge.monitor.metrics import JsonlMetrics, TensorBoardMetrics
from meshforge.monitor.moe import MoeMonitor
from meshforge.monitor.profiling import StepProfiler
from meshforge.monitor.trackers import TrackerSink, build_trackers, check_trackers
from meshforge.monitor.train_state import TrainStateMonitor
from meshforge.monitor.trainer_log import TrainerLog
from meshforge.parallel.dims import ParallelDims
from meshforge.train.batches import plan_batches, shard_for_cp
from meshforge.train.build_model import build_model, build_tokenizer
from meshforge.train.build_preference import build_preference
from meshforge.train.build_reward import build_reward
from meshforge.train.callback_runner import CallbackRunner
from meshforge.train.callbacks import BuiltinCallback, build_callbacks, builtin_callbacks
from meshforge.train.health import StepHealth
from meshforge.train.output_dir import checkpoint_folder, claim_output_dir, remove_earlier_run
from meshforge.train.preemption import PreemptionGuard
from meshforge.train.preference import PreferenceStep
from meshforge.train.preference_pipeline import attach_pipeline_pairs
from meshforge.train.reference_pass import precompute_reference
from meshforge.train.replicas import build_replicas, data_shard, replica_groups
from meshforge.train.reward import RewardStep
from meshforge.train.run import ModelParts, OptimParts, Progress, Run, RunData, RunEnv, Watchers
from meshforge.train.saver import CheckpointSaver
from meshforge.utils import distributed as dist_utils
from meshforge.utils.device import backend_for, resolve_device
from meshforge.utils.log import get_logger
from meshforge.utils.resources import resolve_path
from meshforge.utils.seed import set_deterministic, set_rng_state, set_seed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.checkpoint.config import CheckpointConfig
    from meshforge.checkpoint.manager import TrainerState
    from meshforge.config import TrainConfig
    from meshforge.data.build import LoaderContext
    from meshforge.data.config import TrainDatasetConfig
    from meshforge.data.loader import StatefulLoader, StreamLoader
    from meshforge.data.rampup import BatchRampUp
    from meshforge.monitor.config import MonitorConfig
    from meshforge.optim.config import LrSchedulerConfig, OptimizerConfig
    from meshforge.optim.grad_accum import GradAccumulation
    from meshforge.parallel.config import ParallelismConfig
    from meshforge.parallel.pipeline import Pipeline
    from meshforge.train.config import TrainingConfig

Batch = dict[str, torch.Tensor]
Log = Callable[[str], None]


def build_run(cfg: TrainConfig, log: Log) -> Run:
    """Build every part of the run described by `cfg` (collective: every rank calls it)."""
    env = build_env(cfg, log)
    # User callbacks and tracker packages resolve (and fail, naming the item) before anything
    # heavy is built.
    check_trackers(cfg.monitor)
    callbacks = CallbackRunner(build_callbacks(cfg.callbacks), rank=env.dist.rank, device=env.device)
    plot = builtin_callbacks(cfg.monitor, cfg.callbacks, warn=log)
    plan = env.plan
    log(
        f"meshforge: {env.dims.describe()} on {env.device.type} | global batch "
        f"{plan.global_batch_size} = dp {plan.data_parallel} x local {plan.local_batch_size} "
        f"x accumulation {plan.grad_accum_steps} | output {env.output_dir}"
    )
    rampup = build_rampup(cfg.training, env)
    tokenizer = build_tokenizer(cfg.model, log)
    model = build_model(cfg, env, tokenizer)
    preference = build_preference(cfg, env, model, tokenizer) or build_reward(cfg, env, model)
    loader, loader_context = build_train_data(cfg.train_dataset, cfg.training, env, tokenizer)
    total_steps = resolve_total_steps(cfg.training, loader, log)
    eval_loaders = build_eval_data(cfg.train_dataset, cfg.training.eval_interval, loader_context, log)
    data = RunData(loader, eval_loaders, loader_context, total_steps, rampup)
    if isinstance(
        preference, PreferenceStep
    ):  # pref_ref_logps: precompute: the table pass, before the optimizer
        precompute_reference(cfg, env, model, tokenizer, preference, data)
    optimizer, scheduler = build_optimizer(cfg.optimizer, cfg.lr_scheduler, model, data)
    grad_accum = build_grad_accumulation(cfg.optimizer, model, log)
    pipeline = build_pipeline(cfg.parallelism, env, model)
    if not isinstance(preference, RewardStep):  # rm under PP is refused (config/unsupported.py)
        attach_pipeline_pairs(cfg, env, model, pipeline, preference, tokenizer)
    checkpointer = build_checkpointer(cfg.checkpoint, env, model)
    optim = OptimParts(optimizer, scheduler, grad_accum, pipeline, checkpointer)
    progress = resume(cfg.checkpoint, env, model, data, optim)
    watch = build_watchers(cfg, env, model, data, optim, progress, callbacks=callbacks, plot=plot)
    replicas = build_replicas(
        cfg.parallelism.fault_tolerance,
        rank=env.dist.rank,
        world_size=env.dist.world_size,
        device=env.device,
        data_parallel=env.dims.dp,
        model=model.module,
        optimizer=optim.optimizer,
        scheduler=optim.scheduler,
        loader=data.loader,
        progress=progress,
        log=env.log,
    )
    if isinstance(preference, PreferenceStep) and replicas is not None:
        preference.over_groups = replicas.sum_over_groups  # the pair metrics over every live group
    return Run(
        env=env,
        model=model,
        data=data,
        optim=optim,
        watch=watch,
        progress=progress,
        replicas=replicas,
        preference=preference,
    )


def build_env(cfg: TrainConfig, log: Log) -> RunEnv:
    """Seeds, device, process group, mesh and batch plan; rank 0 writes the resolved config.yaml."""
    set_deterministic(cfg.training.deterministic)
    set_seed(cfg.training.seed)
    dist = dist_utils.env_dist_info()
    device = resolve_device(cfg.context.device_target, local_rank=dist.local_rank)
    if cfg.context.device() == "auto":
        # check_trainable warned about the keys that are no-ops everywhere; now the device is
        # known, so are the ones that are no-ops on it (cpu_offload on the CPU, ...).
        known = noop_notes(cfg, "auto")
        for path, note in noop_notes(cfg, device.type):
            if (path, note) not in known:
                log(f"warning: {path}: {note}")
    dist_utils.init_process_group(backend_for(device), dist)
    dims = ParallelDims.from_config(cfg.parallelism, dist.world_size)
    mesh = dims.build_mesh(device.type)
    # Torchft replica groups are data-parallel replicas: the global batch spans every group.
    plan, batch_note = plan_batches(cfg.training, dims.dp * replica_groups(cfg.parallelism))
    if batch_note:
        log(f"warning: {batch_note}")
    output_dir = resolve_path(cfg.training.output_dir)
    claim = claim_output_dir(cfg, output_dir)  # every rank decides before rank 0 changes anything
    dist_utils.barrier()
    if claim.note:
        log(claim.note)
    if dist.is_main:
        remove_earlier_run(claim)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(dump_config(cfg))
    dist_utils.barrier()
    return RunEnv(
        cfg, log, get_logger("trainer"), dist, device, dims, mesh, plan, output_dir, claim.load_path
    )


def build_rampup(training: TrainingConfig, env: RunEnv) -> BatchRampUp | None:
    """`training.rampup_batch_size` over this run's data-parallel ranks (None: no ramp)."""
    from meshforge.data.rampup import build_rampup as build

    rampup = build(
        training.rampup_batch_size,
        global_batch_size=training.global_batch_size or env.plan.global_batch_size,
        micro_samples=env.plan.data_parallel * env.plan.local_batch_size,
        pipeline_parallel=env.dims.pp,
        epochs=training.epochs is not None,
    )
    if rampup is not None:
        env.log(rampup.describe())
    return rampup


def build_train_data(
    dataset: TrainDatasetConfig, training: TrainingConfig, env: RunEnv, tokenizer: PreTrainedTokenizerBase
) -> tuple[StatefulLoader | StreamLoader, LoaderContext]:
    """The train loader and this rank's `LoaderContext` (shared with the eval loader).

    `training.epochs`, when set, decides the run length (`resolve_total_steps`). The MindSpeed
    importer already applies HF's rule that a positive `max_steps` wins over `num_train_epochs`,
    by not setting `epochs` then.
    """
    from meshforge.data.build import LoaderContext, build_train_loader

    # This rank's shard among every replica group's data ranks (the group's own without torchft).
    dp_rank, dp_size = data_shard(
        env.cfg.parallelism, dp_rank=env.mesh.view("batch").get_local_rank(), dp_size=env.dims.dp
    )
    # One context for the train and the eval loader: SFT data is prepared once for both.
    context = LoaderContext(
        tokenizer=tokenizer,
        local_batch_size=env.plan.local_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        global_batch_size=env.plan.global_batch_size,
        seed=training.seed,
        # Megatron-format data sizes its sample index as steps x global batch, as Megatron does.
        total_steps=training.steps,
        epochs=training.epochs,
        log=env.log,
        # DPO and reward models read ranking datasets, one pair per row (data/sft/pairwise.py).
        pairwise=training.stage in ("dpo", "rm"),
    )
    return build_train_loader(dataset, context), context


def resolve_total_steps(training: TrainingConfig, loader: StatefulLoader | StreamLoader, log: Log) -> int:
    """`training.steps`, or the steps that `training.epochs` passes over the data take."""
    if training.epochs is None:
        return training.steps
    steps = loader.total_steps
    if steps is None:
        raise RuntimeError("training.epochs: the train loader did not size the run (no total_steps)")
    if "steps" in training.model_fields_set and training.steps != steps:
        log(f"training.epochs {training.epochs:g} sets the run to {steps} steps (training.steps not used)")
    return steps


def build_eval_data(
    dataset: TrainDatasetConfig, interval: int | None, context: LoaderContext, log: Log
) -> dict[str, Iterable[Batch]]:
    """The validation loaders by name (val_size, eval_dataset, Megatron split); empty without any.

    `interval` is `training.eval_interval`: set without validation data, it is an error.
    """
    from meshforge.data.build import MIXED_EVAL, build_eval_loaders

    loaders = build_eval_loaders(dataset, context)
    if not loaders and interval is not None:
        raise ValueError(
            "training.eval_interval: there is no validation data: set train_dataset.val_size or "
            "train_dataset.eval_dataset (SFT), or a Megatron split with a validation part "
            "(e.g. split: '98,2,0')"
        )
    if loaders:
        when = f"every {interval} steps and at the end" if interval else "at the end of training"
        each = "" if MIXED_EVAL in loaders else f", each of {len(loaders)} datasets on its own"
        log(f"evaluation: {when} (training.eval_interval){each}")
    return dict(loaders)


def build_optimizer(
    opt: OptimizerConfig, sched: LrSchedulerConfig, model: ModelParts, data: RunData
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The optimizer over the model's parameters and its LR schedule over the run's steps."""
    from meshforge.optim.build import build_optimizer as build
    from meshforge.optim.schedulers import build_lr_scheduler

    optimizer = build(
        model.module.named_parameters(),
        type=opt.type,
        learning_rate=sched.learning_rate,
        betas=tuple(opt.betas),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
        weight_decay_include=opt.weight_decay_include,
        weight_decay_exclude=opt.weight_decay_exclude,
        options=dict(opt.model_extra or {}),
    )
    hook = model.quant.after_optimizer_step if model.quant is not None else None
    if hook is not None:
        # model.fsdp_low_precision_all_gather_mode: all: every weight's float8 scale at once.
        module = model.module
        optimizer.register_step_post_hook(lambda *_args: hook(module))
    scheduler = build_lr_scheduler(
        optimizer,
        type=sched.type,
        learning_rate=sched.learning_rate,
        total_steps=data.total_steps,
        options=dict(sched.model_extra or {}),
        position=data.rampup.schedule_position if data.rampup is not None else None,
    )
    return optimizer, scheduler


def build_grad_accumulation(opt: OptimizerConfig, model: ModelParts, log: Log) -> GradAccumulation:
    """The dtype micro-batch gradients add up in (`optimizer.accumulate_allreduce_grads_in_fp32`)."""
    from meshforge.optim.grad_accum import GradAccumulation

    accum = GradAccumulation(
        model.module.parameters(),
        fp32=opt.accumulate_allreduce_grads_in_fp32,
        params_dtype=model.params_dtype,
        compute_dtype=model.compute_dtype,
    )
    if accum.active:
        log(f"optimizer: {accum.describe()}")
    return accum


def build_pipeline(parallelism: ParallelismConfig, env: RunEnv, model: ModelParts) -> Pipeline | None:
    """The pipeline schedule over this rank's stages (pp > 1), built on the materialised model."""
    if model.pipeline_split is None:
        return None
    from meshforge.parallel.pipeline import build_pipeline as build

    pipeline = build(
        model.pipeline_split,
        model.module,
        env.mesh.view("pp"),
        device=env.device,
        n_microbatches=env.plan.grad_accum_steps,
        schedule=parallelism.pipeline_parallel_schedule,
        dxdw_split=parallelism.pipeline_parallel_enable_dxdw_split,
        # The last stage adds the router aux loss from totals carried through the stages.
        aux_coef=model.aux_coef if model.aux_loss_enabled else 0.0,
        lm_loss=model.lm_loss,
        mtp_coef=model.mtp_coef,
    )
    if env.dims.cp > 1:
        pipeline.eval_shard = functools.partial(
            shard_for_cp, cp_mesh=env.mesh.view("cp"), method=parallelism.cp_method()
        )
    return pipeline


def build_checkpointer(ckpt: CheckpointConfig, env: RunEnv, model: ModelParts) -> CheckpointManager:
    """The DCP checkpoint manager; an empty `checkpoint.save_path` saves into the run folder."""
    save_dir = checkpoint_folder(ckpt, env.output_dir)
    return CheckpointManager(
        save_dir=save_dir,
        prefix=ckpt.prefix,
        interval=ckpt.save_interleaved_steps,
        keep=ckpt.save_max,
        enabled=ckpt.enable_save,
        save_optimizer=not ckpt.no_save_optim,
        rank=env.dist.rank,
        async_save=ckpt.async_save,
        log=env.log,
        lora_base=model.lora_base,
        cache_save_plan=ckpt.save_global_layout_cache,
        model_identity=(model.family.name, getattr(model.module, "config", None)),
        on_save_error=ckpt.on_save_error,
    )


def resume(
    ckpt: CheckpointConfig, env: RunEnv, model: ModelParts, data: RunData, optim: OptimParts
) -> Progress:
    """Load `checkpoint.load_path` (a DCP step or run, or a HF folder) and return where the loop starts.

    A full resume restores the schedule, the data position and the RNGs as well; weights only
    (`no_load_optim`, or a HF folder) start at step 0.
    """
    from meshforge.checkpoint.hf import is_hf_dir, load_hf_weights

    if not env.load_path:
        return Progress()
    load_path = resolve_path(env.load_path)
    if is_hf_dir(load_path):
        if not ckpt.no_load_optim:
            raise ValueError(
                f"checkpoint.load_path: {load_path} is a Hugging Face checkpoint; resuming optimizer "
                "state from it is not possible: set checkpoint.no_load_optim: true to load its weights"
            )
        from meshforge.lora.layer import adapters_detached

        with adapters_detached(model.module):
            load_hf_weights(
                model.module,
                model.family,
                load_path,
                log=env.log,
                vocab_plan=model.vocab_plan,
                partial=model.pipeline_split is not None,
                aliases=model.tied_aliases(),
            )
        if optim.checkpointer.lora_base is not None:
            optim.checkpointer.lora_base = ("hf", load_path)
        env.log("checkpoint: starting at step 0 with the Hugging Face weights (no_load_optim)")
        return Progress()
    loaded = optim.checkpointer.load(
        load_path,
        model.module,
        optim.optimizer,
        load_optimizer=not ckpt.no_load_optim,
        tied_aliases=model.tied_aliases(),
    )
    if not loaded.optimizer_loaded:
        env.log(f"checkpoint: loaded weights from {loaded.path} (no_load_optim: starting at step 0)")
        return Progress()
    state = loaded.trainer_state
    progress = Progress(step=int(state["step"]), tokens_seen=int(state.get("tokens_seen", 0)))
    optim.scheduler.load_state_dict(state["scheduler"])
    data.loader.load_state_dict(state["data"])
    if loaded.rng_state is not None:
        set_rng_state(loaded.rng_state)
    else:
        env.log(f"warning: {loaded.path} has no RNG state for rank {env.dist.rank}; RNGs start fresh")
    env.log(f"checkpoint: resumed from {loaded.path} at step {progress.step}")
    return progress


def build_metrics_logger(
    monitor: MonitorConfig,
    env: RunEnv,
    *,
    total_steps: int,
    start_step: int,
    log_interval: int,
    steps_per_epoch: float | None = None,
) -> MetricsLogger:
    """The sinks (console, metrics.jsonl, TensorBoard, trackers: rank 0 only) as one `MetricsLogger`.

    W&B / SwanLab runs start here, given the resolved config (their packages were checked first).
    """
    if not env.dist.is_main:
        return MetricsLogger(jsonl=None, tensorboard=None, trackers=[], console=None)
    console = ConsoleProgress(
        total=total_steps,
        start=start_step,
        interval=log_interval,
        emit=env.log,
        live=ConsoleProgress.wanted(env.dist.is_main),
    )
    jsonl = JsonlMetrics(env.output_dir / "metrics.jsonl", resume_step=start_step)
    tensorboard = None
    tb = monitor.tensorboard
    if tb.output_dir or "tensorboard" in monitor.trackers():
        # `monitor.report_to: tensorboard` without a folder writes into the run folder.
        folder = resolve_path(tb.output_dir) if tb.output_dir else env.output_dir / "tensorboard"
        tensorboard = TensorBoardMetrics(folder, log_interval=tb.log_interval, queue_size=tb.queue_size)
    config = env.cfg.model_dump(mode="json")
    trackers: list[TrackerSink] = build_trackers(
        monitor, output_dir=env.output_dir, config=config, resuming=start_step > 0
    )
    trainer_log = None
    if monitor.trainer_log:
        trainer_log = TrainerLog(
            env.output_dir,
            total_steps=total_steps,
            start_step=start_step,
            log_interval=log_interval,
            steps_per_epoch=steps_per_epoch,
        )
    return MetricsLogger(
        jsonl=jsonl, tensorboard=tensorboard, trackers=trackers, console=console, trainer_log=trainer_log
    )


def _steps_per_epoch(data: RunData, global_batch_size: int) -> float | None:
    """Optimizer steps per pass over the training rows (the `epoch` of trainer_log.jsonl), when
    the loader knows its rows (a streamed dataset does not)."""
    from meshforge.data.loader import StatefulLoader

    if not isinstance(data.loader, StatefulLoader) or data.rampup is not None:
        return None
    return data.loader.num_samples / global_batch_size


def build_watchers(
    cfg: TrainConfig,
    env: RunEnv,
    model: ModelParts,
    data: RunData,
    optim: OptimParts,
    progress: Progress,
    *,
    callbacks: CallbackRunner,
    plot: list[BuiltinCallback],
) -> Watchers:
    """Run health, preemption, the opt-in monitors, the profiler and the checkpoint saver.

    Collective (the monitors gather names). Each opt-in watcher is None when switched off, so a
    run without them pays nothing per step.
    """
    metrics_logger = build_metrics_logger(
        cfg.monitor,
        env,
        total_steps=data.total_steps,
        start_step=progress.step,
        log_interval=cfg.training.log_interval,
        steps_per_epoch=_steps_per_epoch(data, env.plan.global_batch_size),
    )
    monitor = cfg.monitor
    health = StepHealth.from_monitor(
        monitor.health_checkpoint, written="health_checkpoint" in monitor.model_fields_set, device=env.device
    )
    preemption = PreemptionGuard()
    split = model.pipeline_split
    train_state = TrainStateMonitor.build(
        monitor.train_state,
        model.module,
        rank=env.dist.rank,
        world=env.dist.world_size,
        pp=env.dims.pp,
        device=env.device,
        skip=split.tied_copies if split is not None else (),
    )
    moe_monitor = MoeMonitor.build(
        monitor.moe_monitor,
        model.module,
        log_interval=cfg.training.log_interval,
        world=env.dist.world_size,
        tp=env.dims.tp,
        device=env.device,
        output_dir=env.output_dir if env.dist.is_main else None,
        resume_step=progress.step,
    )
    if moe_monitor is not None and optim.pipeline is not None:
        for stage in optim.pipeline.stages:
            moe_monitor.ignore_inside(stage, "_forward_metadata_inference")
    profiler = StepProfiler.build(
        cfg.profiler,
        rank=env.dist.rank,
        world_size=env.dist.world_size,
        start_step=progress.step,
        total_steps=data.total_steps,
        output_dir=env.output_dir,
        device_type=env.device.type,
        # Other ranks' info lines are muted: a profiled rank's summary is worth a line anyway.
        log=env.log if env.dist.is_main else env.logger.warning,
    )
    saver = CheckpointSaver(
        optim.checkpointer,
        model=model.module,
        optimizer=optim.optimizer,
        trainer_state=functools.partial(trainer_state, progress, env, data, optim),
        preempted=lambda: progress.verdict.preempted,
        total_steps=data.total_steps,
        log=env.log,
        on_save=functools.partial(callbacks.call, "on_save"),
    )
    # The order of the step's decisions: the save before the profiler's end of the step (the
    # window brackets the whole step, save included); the plot at the end.
    builtins: list[BuiltinCallback] = [saver, *([profiler] if profiler is not None else []), *plot]
    return Watchers(
        health, preemption, train_state, moe_monitor, profiler, metrics_logger, saver, callbacks, builtins
    )


def trainer_state(progress: Progress, env: RunEnv, data: RunData, optim: OptimParts) -> TrainerState:
    """What `trainer_state.json` of a checkpoint holds besides model and optimizer."""
    return {
        "step": progress.step,
        "tokens_seen": progress.tokens_seen,
        "scheduler": optim.scheduler.state_dict(),
        "data": data.loader.state_dict(),
        "world_size": env.dist.world_size,
        "global_batch_size": env.plan.global_batch_size,
    }
