"""Import a Megatron-style command line (`pretrain_gpt.py` flags) into a native config dict (torch-free).

Every flag is read (logged `--flag VALUE -> path: value`), warned (no effect here, logged with its
reason) or refused (`not supported yet: --flag (feature)`), as `megatron_table.classify` says; a
name in no argument list is an error with a did-you-mean (`megatron_cmdline`). Megatron's own
defaults are written where they differ from meshforge's (seed 1234, linear decay, Adam's beta2
0.999, weight decay 0.01, dropout 0.1 in attention), so the run is the one Megatron would make.

Data: the GPTDataset reads `train_iters x global_batch_size` train samples, as Megatron asks, so
the sample order equals megatron-core's for the same flags and seed. Outputs: `--save` holds the
checkpoints and, when the flags name no other output folder, the run's metrics and config too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from meshforge.config.base import ConfigError, Issue
from meshforge.config.launch_script import read_script
from meshforge.config.megatron_cmdline import parse_flags
from meshforge.config.megatron_model import model_section, module_names
from meshforge.config.megatron_preference import preference_flags
from meshforge.config.megatron_table import READ, classify
from meshforge.config.megatron_values import Flags, Native
from meshforge.config.recompute_import import megatron_recompute

CP_ALGOS = {
    "ulysses_cp_algo": "ulysses",
    "megatron_cp_algo": "colossal",
    "hybrid_cp_algo": "hybrid",
    "kvallgather_cp_algo": "kvallgather",
}
HF_TOKENIZERS = ("PretrainedFromHF", "HuggingFaceTokenizer")


def _tokenizer_and_data(flags: Flags, native: Native) -> None:
    tokenizer = flags.text("--tokenizer-name-or-path") or flags.text("--tokenizer-model")
    kind = flags.text("--tokenizer-type")
    if kind is not None and kind not in HF_TOKENIZERS:
        flags.refuse(
            "--tokenizer-type",
            f"not supported yet: {kind} (a Hugging Face tokenizer folder: {HF_TOKENIZERS})",
        )
    if tokenizer is not None:
        flag = "--tokenizer-name-or-path" if "--tokenizer-name-or-path" in flags else "--tokenizer-model"
        native.to("model.tokenizer_name_or_path", tokenizer, flag)
    handler = flags.text("--handler-name")
    if handler not in (None, "GeneralPretrainHandler"):
        flags.refuse(
            "--handler-name", f"not supported yet: {handler} (pretraining data: GeneralPretrainHandler)"
        )
    paths = flags.words("--data-path")
    data = "train_dataset.dataloader"
    if not paths:
        return
    native.to(f"{data}.type", "BlendedMegatronDatasetDataLoader", "--data-path")
    native.to(f"{data}.config.data_path", paths, "--data-path")
    native.to(f"{data}.shuffle", False, "--data-path", "the GPTDataset's shuffle index orders the samples")
    native.to("train_dataset.drop_remainder", True, "--data-path")
    seq = flags.int("--seq-length")
    if seq is not None:
        native.to(f"{data}.config.seq_length", seq, "--seq-length")
    else:
        flags.refuse("--seq-length", "required with --data-path (the tokens per sample)")
    native.to(f"{data}.config.split", flags.text("--split", "969, 30, 1"), "--split")
    for flag in ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"):
        if flags.on(flag):
            native.to(f"{data}.config.{flag[2:].replace('-', '_')}", True, flag)
    flags.on("--no-create-attention-mask-in-dataloader")
    cache = flags.text("--data-cache-path")
    if cache is not None:
        native.to(f"{data}.config.path_to_cache", cache, "--data-cache-path")
    workers = flags.int("--num-workers")
    if workers is not None:
        native.to("train_dataset.num_parallel_workers", workers, "--num-workers")
    eod = _eos_id(tokenizer)
    if eod is not None:
        native.to(
            f"{data}.config.eod", eod, "--tokenizer-name-or-path", "the tokenizer's eos id, Megatron's eod"
        )


def _eos_id(folder: str | None) -> int | None:
    """The eos token id of a Hugging Face tokenizer folder (Megatron's HF tokenizers' `eod`)."""
    if folder is None:
        return None
    try:
        config = json.loads((Path(folder) / "tokenizer_config.json").read_text(encoding="utf-8"))
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        tokens = json.loads((Path(folder) / "tokenizer.json").read_text(encoding="utf-8"))
        for added in tokens.get("added_tokens", []):
            if added.get("content") == eos:
                return int(added["id"])
        vocab = tokens["model"]["vocab"]
        return int(vocab[eos]) if isinstance(vocab, dict) and eos in vocab else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _training(flags: Flags, native: Native) -> None:
    mbs = flags.int("--micro-batch-size", 1)
    native.to("training.local_batch_size", mbs, "--micro-batch-size")
    gbs = flags.int("--global-batch-size")
    if gbs is not None:
        native.to("training.global_batch_size", gbs, "--global-batch-size")
    iters, samples = run_length(flags)
    if iters is None:
        flags.refuse(
            "--train-iters", "required: give --train-iters (or --train-samples with --global-batch-size)"
        )
    elif samples is None:
        native.to(
            "training.steps", iters, "--train-iters", "train samples: steps x global batch, as Megatron asks"
        )
    else:
        native.to("training.steps", iters, "--train-samples", f"{samples} samples // global batch {gbs}")
        if "--data-path" in flags:
            native.to(
                "train_dataset.dataloader.sizes",
                [samples],
                "--train-samples",
                "the GPTDataset's train samples",
            )
    ramp = flags.words("--rampup-batch-size")
    if ramp:
        native.to("training.rampup_batch_size", [int(v) for v in ramp if v.isdigit()], "--rampup-batch-size")
    native.to("training.seed", flags.int("--seed", 1234), "--seed")
    clip = flags.float("--clip-grad", 1.0)
    if clip == 0:
        flags.refuse("--clip-grad", "not supported yet: --clip-grad 0 (no clipping)")
    else:
        native.to("training.max_norm", clip, "--clip-grad")
    optimizer = flags.text("--optimizer", "adam")
    names = {"adam": "AdamW", "adamw": "AdamW", "muon": "Muon"}
    if optimizer not in names:
        flags.refuse("--optimizer", f"not supported yet: {optimizer} (adam, muon)")
    else:
        native.to(
            "optimizer.type", names[str(optimizer)], "--optimizer", "Megatron's Adam decays weights decoupled"
        )
    native.to("optimizer.weight_decay", flags.float("--weight-decay", 0.01), "--weight-decay")
    betas = [flags.float("--adam-beta1", 0.9), flags.float("--adam-beta2", 0.999)]
    native.to("optimizer.betas", betas, "--adam-beta2" if "--adam-beta2" in flags else "--adam-beta1")
    native.to("optimizer.eps", flags.float("--adam-eps", 1e-8), "--adam-eps")
    if flags.on("--bf16"):
        native.to("model.compute_dtype", "bfloat16", "--bf16", "fp32 master weights")
    elif flags.on("--fp16"):
        flags.refuse("--fp16", "not supported yet: fp16 training with loss scaling (use --bf16)")
    else:
        native.to("model.compute_dtype", "float32", "--bf16", "neither --bf16 nor --fp16: fp32, as Megatron")
    if flags.on("--calculate-per-token-loss"):
        native.to("training.calculate_per_token_loss", True, "--calculate-per-token-loss")
    _schedule(flags, native, iters)


def run_length(flags: Flags) -> tuple[int | None, int | None]:
    """(iterations, train samples when given in samples): Megatron's `train_samples // global batch`."""
    iters = flags.int("--train-iters")
    samples = flags.int("--train-samples")
    gbs = flags.int("--global-batch-size")
    if iters is not None or samples is None:
        return iters, None
    if gbs is None or flags.words("--rampup-batch-size"):
        flags.refuse("--train-samples", "needs --global-batch-size and no --rampup-batch-size here")
        return None, None
    return samples // gbs, samples


def _in_iterations(flags: Flags, flag: str, gbs: int | None) -> int | None:
    """A schedule length in samples (`--lr-*-samples`) as iterations: Megatron steps its scheduler
    by the global batch in sample mode, so the length in iterations is samples / global batch."""
    samples = flags.int(flag)
    if samples is None:
        return None
    if not gbs:
        flags.refuse(flag, "needs --global-batch-size")
        return None
    return round(samples / gbs)


def _schedule(flags: Flags, native: Native, iters: int | None) -> None:
    """Megatron's OptimizerParamScheduler: linear warm-up from --lr-warmup-init, then the decay
    style from --lr to --min-lr over --lr-decay-iters (default --train-iters), --min-lr after."""
    lr = flags.float("--lr")
    if lr is None:
        flags.refuse("--lr", "required: give --lr")
        return
    native.to("lr_scheduler.learning_rate", lr, "--lr")
    gbs = flags.int("--global-batch-size")
    decay = flags.int("--lr-decay-iters")
    if decay is None:
        decay = _in_iterations(flags, "--lr-decay-samples", gbs)
        if decay is not None:
            native.say(f"--lr-decay-samples -> {decay} decay iterations (samples / global batch {gbs})")
    decay = iters if decay is None else decay
    style = flags.text("--lr-decay-style", "linear")
    types = {"linear": "LinearWithWarmUpLR", "cosine": "CosineWithWarmUpLR", "constant": "ConstantWarmUpLR"}
    if style not in types:
        flags.refuse("--lr-decay-style", f"not supported yet: {style} (linear, cosine, constant)")
        return
    native.to("lr_scheduler.type", types[str(style)], "--lr-decay-style")
    warmup = flags.int("--lr-warmup-iters")
    if warmup is None and "--lr-warmup-samples" in flags:
        warmup = _in_iterations(flags, "--lr-warmup-samples", gbs)
    fraction = flags.float("--lr-warmup-fraction")
    if fraction is not None and decay is not None:
        warmup = int(fraction * decay)
        native.to(
            "lr_scheduler.warmup_steps",
            warmup,
            "--lr-warmup-fraction",
            f"{fraction} x {decay} decay iterations",
        )
    else:
        flag = (
            "--lr-warmup-samples"
            if "--lr-warmup-samples" in flags and "--lr-warmup-iters" not in flags
            else "--lr-warmup-iters"
        )
        native.to("lr_scheduler.warmup_steps", warmup or 0, flag)
    init = flags.float("--lr-warmup-init")
    if init:
        native.to("lr_scheduler.warmup_lr_init", init, "--lr-warmup-init")
    if style == "constant":
        flags.read.add("--min-lr")
        return
    native.to("lr_scheduler.min_lr", flags.float("--min-lr", 0.0), "--min-lr")
    if decay is not None and decay != iters:
        key = "decay_steps" if style == "cosine" else "total_steps"
        native.to(f"lr_scheduler.{key}", decay, "--lr-decay-iters")


def _parallel(flags: Flags, native: Native, family: str | None) -> None:
    degrees = {
        "--tensor-model-parallel-size": "tensor_parallel",
        "--pipeline-model-parallel-size": "pipeline_parallel",
        "--context-parallel-size": "context_parallel",
        "--expert-model-parallel-size": "expert_parallel",
    }
    for flag, key in degrees.items():
        value = flags.int(flag)
        if value is not None:
            native.to(f"parallelism.{key}", value, flag)
    tp = flags.int("--tensor-model-parallel-size", 1) or 1
    if flags.on("--sequence-parallel") and tp > 1:
        native.to("parallelism.sequence_parallel", True, "--sequence-parallel")
    elif tp > 1:
        flags.refuse(
            "--sequence-parallel", "TP without sequence parallelism is not offered: add --sequence-parallel"
        )
    cp = flags.int("--context-parallel-size", 1) or 1
    algo = flags.text("--context-parallel-algo")
    if algo is not None:
        if algo not in CP_ALGOS:
            flags.refuse("--context-parallel-algo", f"not supported yet: {algo} ({sorted(CP_ALGOS)})")
        elif cp > 1:
            native.to("parallelism.context_parallel_method", CP_ALGOS[algo], "--context-parallel-algo")
    vpp = flags.int("--num-layers-per-virtual-pipeline-stage")
    pp = flags.int("--pipeline-model-parallel-size", 1) or 1
    layers = flags.int("--num-layers") or 0
    if vpp:
        chunks = layers // (pp * vpp) if pp * vpp else 0
        native.to(
            "parallelism.pipeline_parallel_interleave_num", chunks, "--num-layers-per-virtual-pipeline-stage"
        )
        native.to(
            "parallelism.pipeline_parallel_schedule",
            "interleaved1f1b",
            "--num-layers-per-virtual-pipeline-stage",
        )
    dist_opt = flags.on("--use-distributed-optimizer")
    native.to(
        "parallelism.data_parallel_shard",
        -1,
        "--use-distributed-optimizer",
        "FSDP over the data ranks"
        if dist_opt
        else "Megatron's DDP -> FSDP over the data ranks: the same update",
    )
    _recompute(flags, native, family)


def _recompute(flags: Flags, native: Native, family: str | None) -> None:
    flat: dict[str, object] = {}
    if flags.on("--recompute-activations"):
        flat["recompute_granularity"] = "selective"
    for flag in ("--recompute-granularity", "--recompute-method"):
        if flag in flags:
            flat[flag[2:].replace("-", "_")] = flags.text(flag)
    if "--recompute-num-layers" in flags:
        flat["recompute_num_layers"] = flags.int("--recompute-num-layers")
    modules = flags.words("--recompute-modules")
    if not flat:
        if modules:
            flags.refuse("--recompute-modules", "only with --recompute-granularity selective")
        return
    issues: list[Issue] = []

    def to(path: str, value: object, key: str) -> None:
        native.to(path, value, f"--{key.replace('_', '-')}")

    if modules and modules != ["core_attn"] and flat.get("recompute_granularity") == "selective":
        words = {"core_attn": "self_attn", "mlp": "mlp", "moe": "mlp", "layernorm": None}
        paths: list[str] = []
        for word in modules:
            if word not in words:
                flags.refuse(
                    "--recompute-modules",
                    f"not supported yet: recomputing {word!r} (core_attn, mlp, moe, layernorm)",
                )
            elif word == "layernorm":
                paths += ["model.layers.{*}.input_layernorm", "model.layers.{*}.post_attention_layernorm"]
            else:
                paths.append(f"model.layers.{{*}}.{words[word]}")
        native.to("recompute.mode", "full", "--recompute-granularity")
        native.to("recompute.modules", sorted(set(paths)), "--recompute-modules", f"{family}'s modules")
        return
    megatron_recompute(flat, to, native.say, issues)
    for key, reason in issues:
        flags.refuse(f"--{key.replace('_', '-')}", reason)


def _outputs(flags: Flags, native: Native) -> None:
    save = flags.text("--save")
    load = flags.text("--load")
    if save is not None:
        native.to("checkpoint.save_path", save, "--save")
        native.to(
            "training.output_dir",
            save,
            "--save",
            "no output folder named: metrics.jsonl and config.yaml go beside the checkpoints",
        )
    else:
        native.to("checkpoint.enable_save", False, "--save", "no --save: no checkpoint, as in Megatron")
    interval = flags.int("--save-interval")
    if interval is not None and save is not None:
        native.to("checkpoint.save_interleaved_steps", interval, "--save-interval")
    if load is not None and native.get("model.model_name_or_path") is None:
        folder = Path(load)
        if (folder / "latest_checkpointed_iteration.txt").is_file():
            flags.refuse(
                "--load",
                f"not supported yet: Megatron's checkpoint format in {load} (convert it to a Hugging Face folder)",
            )
        elif load == save:
            native.to(
                "checkpoint.load_path",
                "auto",
                "--load",
                "the latest complete step in --save, or a fresh start",
            )
        elif folder.is_dir():
            native.to("checkpoint.load_path", load, "--load")
        else:
            flags.refuse("--load", f"{load}: no such folder")
    finetune, no_optim = flags.on("--finetune"), flags.on("--no-load-optim")
    if finetune or no_optim:
        note = "weights only, from step 0"
        if no_optim and not finetune:
            note += " (Megatron's --no-load-optim alone keeps the checkpoint's iteration)"
        native.to("checkpoint.no_load_optim", True, "--finetune" if finetune else "--no-load-optim", note)
    if flags.on("--no-save-optim"):
        native.to("checkpoint.no_save_optim", True, "--no-save-optim")
    if flags.on("--no-shared-storage"):
        native.to("train_dataset.no_shared_storage", True, "--no-shared-storage")
    fmt = flags.text("--ckpt-format")
    if fmt is not None:
        native.say(
            f"--ckpt-format {fmt} -> checkpoints are PyTorch DCP step folders (torch.distributed.checkpoint)"
        )
    flags.on("--exit-on-missing-checkpoint")


def _logging(flags: Flags, native: Native) -> None:
    native.to("training.log_interval", flags.int("--log-interval", 100), "--log-interval")
    split = flags.text("--split", "969, 30, 1") or ""
    shares = [float(v) for v in re.findall(r"[0-9.]+", split)]
    iters = flags.int("--eval-iters", 100) or 0
    interval = flags.int("--eval-interval", 1000)
    if len(shares) > 1 and shares[1] > 0 and iters > 0 and "--data-path" in flags:
        native.to("training.eval_interval", interval, "--eval-interval")
        native.to(
            "training.eval_iters",
            iters,
            "--eval-iters",
            "each evaluation reads the validation split from its start",
        )
        (train_iters, samples), gbs = run_length(flags), flags.int("--global-batch-size")
        if train_iters and gbs and interval:
            # Megatron's valid/test sample counts: the validation dataset's order depends on them
            valid = (train_iters // interval + 1) * iters * gbs
            native.to(
                "train_dataset.dataloader.sizes",
                [samples or 0, valid, iters * gbs],
                "--eval-iters",
                "train: train_iters x global batch; valid and test as Megatron counts them",
            )
    board = flags.text("--tensorboard-dir")
    if board is not None:
        native.to("monitor.tensorboard.output_dir", board, "--tensorboard-dir")
    if flags.on("--log-throughput"):
        native.to("training.log_throughput", True, "--log-throughput")
    project = flags.text("--wandb-project")
    if project:
        native.to("monitor.report_to", "wandb", "--wandb-project")
        native.to("monitor.wandb.project", project, "--wandb-project")
        name = flags.text("--wandb-exp-name")
        if name:
            native.to("monitor.wandb.name", name, "--wandb-exp-name")
    if flags.on("--profile"):
        native.to("profiler.enable_profiling", True, "--profile")
        for flag, key in (("--profile-step-start", "start_step"), ("--profile-step-end", "end_step")):
            value = flags.int(flag)
            if value is not None:
                native.to(f"profiler.{key}", value, flag)
        ranks = flags.words("--profile-ranks")
        if ranks:
            native.to("profiler.profiler_rank", [int(r) for r in ranks if r.isdigit()], "--profile-ranks")


def _lora(flags: Flags, native: Native, family: str | None) -> None:
    rank = flags.int("--lora-r")
    if rank is None:
        return
    native.to("lora_config.lora_rank", rank, "--lora-r")
    alpha = flags.int("--lora-alpha")
    if alpha is not None:
        native.to("lora_config.lora_alpha", alpha, "--lora-alpha")
    names = flags.words("--lora-target-modules")
    if names and family is not None:
        native.to(
            "lora_config.target_modules",
            module_names(family, names, "--lora-target-modules", flags),
            "--lora-target-modules",
        )


def import_megatron(
    tokens: list[str],
    log: Callable[[str], None] | None = None,
    origins: dict[str, tuple[str, object]] | None = None,
) -> dict[str, object]:
    """Map Megatron flags to a native config dict; raises ConfigError listing every problem."""
    say = log or (lambda _line: None)
    given, issues = parse_flags(tokens, say)
    flags = Flags(given, issues)
    native = Native(flags, say, origins if origins is not None else {})
    for flag in given:
        kind = classify(flag)
        if kind is None or kind.kind == "read":
            continue
        if kind.kind == "refused":
            issues.append((flag, f"not supported yet: {flag} ({kind.detail})"))
        else:
            say(f"{flag}: no effect here ({kind.detail})")
    _tokenizer_and_data(flags, native)
    family = model_section(flags, native)
    _training(flags, native)
    _parallel(flags, native, family)
    _outputs(flags, native)
    _logging(flags, native)
    _lora(flags, native, family)
    preference_flags(flags, native)
    for flag in ("--use-mcore-models", "--group-query-attention", "--no-position-embedding"):
        flags.on(flag)
    unread = [f for f in given if f in READ and f not in flags.read]
    for flag in unread:
        say(f"{flag}: no effect with the other flags given ({READ[flag]})")
    if issues:
        raise ConfigError(issues)
    return native.data


def import_launch_script(
    path: str, log: Callable[[str], None] | None = None, origins: dict[str, tuple[str, object]] | None = None
) -> dict[str, object]:
    """`import_megatron` of the training line of a launch script (`launch_script.read_script`)."""
    say = log or (lambda _line: None)
    line = read_script(path, say)
    say(f"{path}:{line.line}: the training line runs {line.entry} with {len(line.flags)} words of flags")
    if line.launcher:
        say(
            f"launcher: {' '.join(line.launcher)} -> not read: the world size comes from the environment "
            "torchrun sets when the run starts (`torchrun ... -m meshforge megatron ...` or `meshforge train SCRIPT`)"
        )
    return import_megatron(line.flags, say, origins)
