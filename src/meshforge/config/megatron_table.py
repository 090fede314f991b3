"""What meshforge does with each Megatron-style flag: read, refused, or warned (torch-free).

Every flag of `megatron_flags.FLAGS` (Megatron-LM's parser and the derived projects' flags) gets
exactly one class from `classify`:

* **read**: `READ` names where the flag goes in the native config; `megatron_import` maps it and
  logs `--flag VALUE -> path: value`;
* **warned**: no effect on how meshforge trains (a fusion or kernel switch, a communication
  schedule, a log detail meshforge does not keep, a launcher or hardware setting), logged with its
  reason (`WARNED`, then the word and group rules below);
* **refused**: a Megatron feature meshforge does not build: `not supported yet: --flag (feature)`;
  `REFUSED` names the feature of the common ones, the rest are named by their argparse group.

`tests/unit/test_megatron_table.py` walks every flag through `classify` and checks that each read
flag has a handler in the mapper. docs/config-mapping.md's Megatron table is `markdown_table()`.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from meshforge.config.megatron_flags import DERIVED_SOURCE, FLAGS, MEGATRON_SOURCE

Kind = Literal["read", "refused", "warned"]


class FlagClass(NamedTuple):
    """A flag's class and its detail: the native path(s) (read), the feature (refused), the reason (warned)."""

    kind: Kind
    detail: str


_MODEL = "model."
READ: dict[str, str] = {
    # the model
    "--num-layers": "model.num_hidden_layers",
    "--hidden-size": "model.hidden_size",
    "--ffn-hidden-size": "model.intermediate_size",
    "--num-attention-heads": "model.num_attention_heads",
    "--group-query-attention": "model.num_key_value_heads (with --num-query-groups)",
    "--num-query-groups": "model.num_key_value_heads",
    "--kv-channels": "model.head_dim",
    "--qk-layernorm": "the family (q/k RMSNorm: qwen3, qwen3_moe; none: llama)",
    "--normalization": "RMSNorm only (model.rms_norm_eps)",
    "--norm-epsilon": "model.rms_norm_eps",
    "--swiglu": "model.hidden_act: silu (gated MLP)",
    "--disable-bias-linear": "model.attention_bias: false (and mlp_bias)",
    "--add-qkv-bias": "model.attention_bias (llama: q/k/v/o biases)",
    "--position-embedding-type": "rope only",
    "--use-rotary-position-embeddings": "rope",
    "--no-position-embedding": "no learned absolute positions (rope)",
    "--rotary-base": "model.rope_theta",
    "--rotary-percent": "1.0 only (rope on the whole head)",
    "--untie-embeddings-and-output-weights": "model.tie_word_embeddings: false",
    "--padded-vocab-size": "model.vocab_size",
    "--vocab-size": "model.vocab_size (before padding)",
    "--make-vocab-size-divisible-by": "model.vocab_size (the tokenizer's, padded as Megatron pads)",
    "--max-position-embeddings": "model.max_position_embeddings",
    "--init-method-std": "model.initializer_range",
    "--attention-dropout": "model.attention_dropout",
    "--hidden-dropout": "0 only (no residual dropout)",
    "--spec": "the family (model.model_type)",
    "--model-type-hf": "the family (model.model_type)",
    "--use-mcore-models": "(the only kind)",
    # MoE
    "--num-experts": "model.num_experts / model.n_routed_experts",
    "--moe-router-topk": "model.num_experts_per_tok",
    "--moe-ffn-hidden-size": "model.moe_intermediate_size",
    "--moe-shared-expert-intermediate-size": "model.n_shared_experts (x moe_intermediate_size)",
    "--n-shared-experts": "model.n_shared_experts",
    "--moe-layer-freq": "model.first_k_dense_replace / model.mlp_only_layers",
    "--first-k-dense-replace": "model.first_k_dense_replace / model.mlp_only_layers",
    "--moe-router-score-function": "softmax (qwen3_moe) or sigmoid (deepseek_v3)",
    "--moe-router-enable-expert-bias": "deepseek_v3's e_score_correction_bias",
    "--moe-router-topk-scaling-factor": "model.routed_scaling_factor",
    "--moe-router-num-groups": "model.n_group",
    "--moe-router-group-topk": "model.topk_group",
    "--norm-topk-prob": "model.norm_topk_prob",
    "--moe-router-pre-softmax": "softmax before top-k (the family's order)",
    "--moe-router-load-balancing-type": "aux_loss / seq_aux_loss / none: training.router_aux_loss_coef",
    "--moe-aux-loss-coeff": "training.router_aux_loss_coef",
    "--expert-model-parallel-size": "parallelism.expert_parallel",
    # MLA and MTP
    "--multi-latent-attention": "the family deepseek_v3",
    "--q-lora-rank": "model.q_lora_rank",
    "--kv-lora-rank": "model.kv_lora_rank",
    "--qk-head-dim": "model.qk_nope_head_dim",
    "--qk-pos-emb-head-dim": "model.qk_rope_head_dim",
    "--v-head-dim": "model.v_head_dim",
    "--mtp-num-layers": "model.num_nextn_predict_layers",
    "--mtp-loss-scaling-factor": "training.mtp_loss_scaling_factor",
    # data
    "--data-path": "train_dataset.dataloader.config.data_path",
    "--split": "train_dataset.dataloader.config.split",
    "--seq-length": "train_dataset.dataloader.config.seq_length",
    "--tokenizer-type": "PretrainedFromHF / HuggingFaceTokenizer only",
    "--tokenizer-name-or-path": "model.tokenizer_name_or_path",
    "--tokenizer-model": "model.tokenizer_name_or_path",
    "--reset-position-ids": "train_dataset.dataloader.config.reset_position_ids",
    "--reset-attention-mask": "train_dataset.dataloader.config.reset_attention_mask",
    "--eod-mask-loss": "train_dataset.dataloader.config.eod_mask_loss",
    "--num-workers": "train_dataset.num_parallel_workers",
    "--data-cache-path": "train_dataset.dataloader.config.path_to_cache",
    "--no-create-attention-mask-in-dataloader": "train_dataset.dataloader.config.create_attention_mask: false",
    "--handler-name": "GeneralPretrainHandler only (the preprocessing handler)",
    # training
    "--micro-batch-size": "training.local_batch_size",
    "--global-batch-size": "training.global_batch_size",
    "--rampup-batch-size": "training.rampup_batch_size",
    "--train-iters": "training.steps (and the train sample count x global batch)",
    "--train-samples": "training.steps: samples // global batch; train_dataset.dataloader.sizes[0]",
    "--lr-decay-samples": "lr_scheduler.decay_steps / total_steps: samples / global batch",
    "--lr-warmup-samples": "lr_scheduler.warmup_steps: samples / global batch",
    "--lr": "lr_scheduler.learning_rate",
    "--min-lr": "lr_scheduler.min_lr",
    "--lr-decay-style": "lr_scheduler.type",
    "--lr-decay-iters": "lr_scheduler.decay_steps",
    "--lr-warmup-iters": "lr_scheduler.warmup_steps",
    "--lr-warmup-fraction": "lr_scheduler.warmup_ratio",
    "--lr-warmup-init": "lr_scheduler.warmup_lr_init",
    "--weight-decay": "optimizer.weight_decay",
    "--clip-grad": "training.max_norm",
    "--adam-beta1": "optimizer.betas[0]",
    "--adam-beta2": "optimizer.betas[1]",
    "--adam-eps": "optimizer.eps",
    "--optimizer": "optimizer.type (adam -> AdamW)",
    "--bf16": "model.compute_dtype: bfloat16",
    "--fp16": "model.compute_dtype: float16",
    "--seed": "training.seed",
    "--recompute-granularity": "recompute.mode",
    "--recompute-method": "recompute.full_recompute_layer / recompute.modules",
    "--recompute-num-layers": "recompute.full_recompute_layer",
    "--recompute-activations": "recompute (selective)",
    "--recompute-modules": "recompute.modules (the family's module names)",
    "--calculate-per-token-loss": "training.calculate_per_token_loss",
    # parallel
    "--tensor-model-parallel-size": "parallelism.tensor_parallel",
    "--pipeline-model-parallel-size": "parallelism.pipeline_parallel",
    "--context-parallel-size": "parallelism.context_parallel",
    "--context-parallel-algo": "parallelism.context_parallel_method",
    "--num-layers-per-virtual-pipeline-stage": "parallelism.pipeline_parallel_interleave_num",
    "--sequence-parallel": "parallelism.sequence_parallel",
    "--use-distributed-optimizer": "parallelism.data_parallel_shard: -1 (FSDP)",
    # checkpoints and output
    "--save": "checkpoint.save_path (and training.output_dir beside it)",
    "--load": "model.model_name_or_path (a HF folder) or checkpoint.load_path",
    "--save-interval": "checkpoint.save_interleaved_steps",
    "--no-load-optim": "checkpoint.no_load_optim",
    "--no-save-optim": "checkpoint.no_save_optim",
    "--ckpt-format": "DCP (torch_dist, torch: logged)",
    "--finetune": "checkpoint.no_load_optim + step 0 (weights only)",
    "--exit-on-missing-checkpoint": "a missing --load is an error (as always here)",
    # logging and evaluation
    "--log-interval": "training.log_interval",
    "--eval-interval": "training.eval_interval",
    "--eval-iters": "training.eval_iters (and the valid sample count)",
    "--tensorboard-dir": "monitor.tensorboard.output_dir",
    "--log-throughput": "training.log_throughput",
    "--wandb-project": "monitor.wandb.project (monitor.report_to: wandb)",
    "--wandb-exp-name": "monitor.wandb.name",
    "--profile": "profiler.enable_profiling",
    "--profile-step-start": "profiler.start_step",
    "--profile-step-end": "profiler.end_step",
    "--profile-ranks": "profiler.profiler_rank",
    # LoRA (MindSpeed-LLM)
    "--lora-r": "lora_config.lora_rank",
    "--lora-alpha": "lora_config.lora_alpha",
    "--lora-target-modules": "lora_config.target_modules (the family's module names)",
    "--no-shared-storage": "train_dataset.no_shared_storage",
    # preference training (MindSpeed-LLM's posttrain_gpt.py; megatron_preference.py)
    "--stage": "training.stage (dpo; the other posttrain stages are refused)",
    "--dpo-beta": "training.pref_beta",
    "--dpo-loss-type": "training.pref_loss (sigmoid, hinge, ipo)",
    "--dpo-label-smoothing": "training.dpo_label_smoothing",
    "--pref-ftx": "training.pref_ftx",
    "--ref-model": "the policy's own source only (the reference is built from model.model_name_or_path)",
}

# Flags with no effect on what meshforge trains, and why.
_FUSION = "a fusion or kernel switch: meshforge picks its own kernels (the kernels section)"
_COMM = "a communication schedule or buffer setting of Megatron's DDP/optimizer: FSDP2 schedules its own"
_LAUNCH = "a launcher or process-group setting: torchrun's environment decides"
WARNED: dict[str, str] = {
    "--transformer-impl": "meshforge builds its own modules (no Transformer Engine / local switch)",
    "--attention-backend": _FUSION,
    "--use-flash-attn": _FUSION,
    "--distributed-backend": "the backend follows the device (nccl, gloo, hccl)",
    "--distributed-timeout-minutes": _LAUNCH,
    "--local-rank": _LAUNCH,
    "--initial-loss-scale": "loss scaling applies to fp16 only; bf16 and fp32 runs do not scale",
    "--loss-scale": "loss scaling applies to fp16 only; bf16 and fp32 runs do not scale",
    "--loss-scale-window": "loss scaling applies to fp16 only; bf16 and fp32 runs do not scale",
    "--min-loss-scale": "loss scaling applies to fp16 only; bf16 and fp32 runs do not scale",
    "--hysteresis": "loss scaling applies to fp16 only; bf16 and fp32 runs do not scale",
    "--attention-softmax-in-fp32": "the attention softmax always accumulates in float32 here",
    "--accumulate-allreduce-grads-in-fp32": "gradients are reduced in float32 (parallelism.reduce_dtype)",
    "--grad-reduce-in-bf16": "gradients are reduced in parallelism.reduce_dtype (float32)",
    "--manual-gc": "Python's garbage collector is left as it is",
    "--manual-gc-interval": "Python's garbage collector is left as it is",
    "--empty-unused-memory-level": "the allocator's cache is left as it is",
    "--exit-duration-in-mins": "a wall-clock stop: use the job scheduler's limit (preemption saves a step)",
    "--no-check-for-nan-in-loss-and-grad": "non-finite steps are always skipped (train/health.py)",
    "--dataloader-type": "the loader is meshforge's stateful sampler (single)",
    "--no-mmap-bin-files": ".bin files are memory-mapped",
    "--log-params-norm": "metrics.jsonl has grad_norm; parameter norms: monitor.train_state",
    "--log-num-zeros-in-grad": "not logged here",
    "--log-timers-to-tensorboard": "meshforge logs tokens/s and step time",
    "--log-memory-to-tensorboard": "memory is logged by monitor.train_state",
    "--log-validation-ppl-to-tensorboard": "eval_loss is logged; ppl = exp(eval_loss)",
    "--logging-level": "meshforge's log level is fixed (INFO on rank 0)",
    "--timing-log-level": "meshforge logs step time on log steps",
    "--no-load-rng": "every rank's RNG state is restored with the step",
    "--enable-experimental": "Megatron's experimental switch; nothing here depends on it",
    "--use-cpu-initialization": "weights are built on the meta device and initialised per shard",
    "--use-fused-rmsnorm": _FUSION,
    "--use-fused-swiglu": _FUSION,
    "--use-fused-rotary-pos-emb": _FUSION,
    "--use-fused-ring-attention-update": _FUSION,
    "--use-ascend-coc": _FUSION,
    "--coc-fused-kernel": _FUSION,
    "--use-ascend-mc2": _FUSION,
    "--gemm-gradient-accumulation-fusion": _FUSION,
    "--npu-deterministic": "training.deterministic decides (an NPU switch)",
    "--moe-permutation-async-comm": _COMM,
    "--moe-alltoall-overlap-comm": _COMM,
    "--reuse-fp32-param": "an NPU memory layout of Megatron's optimizer",
    "--enable-hf2mg-convert": "HF folders are read directly (no conversion to Megatron's format)",
    "--moe-grouped-gemm": "kernels.moe_grouped_gemm picks the experts' kernel",
    "--moe-token-dispatcher-type": "the EP dispatch is the all-to-all of parallel/expert.py",
    "--moe-router-dtype": "the router computes in float32",
    "--moe-router-force-load-balancing": "a benchmarking switch of Megatron (random routing)",
    "--moe-router-bias-update-rate": "meshforge updates the expert bias at its own rate",
    "--no-bias-swiglu-fusion": _FUSION,
    "--no-rope-fusion": _FUSION,
    "--moe-permute-fusion": _FUSION,
}

# Words in a flag name that mark a kernel, fusion or communication-schedule switch.
_FUSION_WORDS = ("fusion", "fused", "-fuser", "cuda-graph", "-sms", "nccl", "nvls", "-ub", "tp-comm")
_COMM_WORDS = ("overlap", "ddp-", "bucket", "prefetch", "-align-")
# Groups whose flags do not change what is trained, and why.
WARNED_GROUPS: dict[str, str] = {
    "logging": "a log detail meshforge does not keep (it writes metrics.jsonl, the console and TensorBoard)",
    "one logger": "NVIDIA's one-logger telemetry is not used",
    "straggler": "meshforge reports stragglers itself (monitor/stragglers.py)",
    "workload inspector": "NVIDIA's workload inspector server is not used",
    "opentelemetry": "OpenTelemetry export is not used",
    "Transformer-Engine": "Transformer Engine is not used",
}

# The feature that refused flags belong to, by flag.
REFUSED: dict[str, str] = {
    "--is-instruction-dataset": "MindSpeed-LLM's preprocessed instruction data (the _packed_input_ids/_attention_mask/_labels_document datasets); train SFT from the raw data with meshforge's SFT loader",
    "--no-pad-to-seq-lengths": "MindSpeed-LLM's preprocessed instruction data (the _packed_input_ids/_attention_mask/_labels_document datasets); train SFT from the raw data with meshforge's SFT loader",
    "--prompt-type": "MindSpeed-LLM's preprocessed instruction data (the _packed_input_ids/_attention_mask/_labels_document datasets); train SFT from the raw data with meshforge's SFT loader",
    "--is-pairwise-dataset": "MindSpeed-LLM's preprocessed pairwise data (the _packed_chosen_/_packed_rejected_ input_ids and labels datasets); train DPO from the raw ranking data with meshforge's SFT loader (a `ranking: true` dataset, docs/preference.md)",
    "--no-shuffle": "Megatron data read without its shuffle index",
    "--decoupled-lr": "a separate LR for the embedding and output layer",
    "--decoupled-min-lr": "a separate LR for the embedding and output layer",
    "--apply-layernorm-1p": "zero-centred norm weights (layernorm 1p)",
    "--rotary-scaling-factor": "rope scaling from flags (read it from --load's config.json)",
    "--use-rope-scaling": "rope scaling from flags (read it from --load's config.json)",
    "--rope-scaling-factor": "rope scaling from flags (read it from --load's config.json)",
    "--mscale": "YaRN scaling from flags (read it from --load's config.json)",
    "--mscale-all-dim": "YaRN scaling from flags (read it from --load's config.json)",
    "--vocab-file": "Megatron's GPT2/BERT vocabulary files (use a Hugging Face tokenizer folder)",
    "--merge-file": "Megatron's GPT2/BERT vocabulary files (use a Hugging Face tokenizer folder)",
    "--train-data-path": "separate train/valid/test data paths (use --data-path with --split)",
    "--valid-data-path": "separate train/valid/test data paths (use --data-path with --split)",
    "--test-data-path": "separate train/valid/test data paths (use --data-path with --split)",
    "--fp8-format": "FP8 training from Megatron flags (use model.quant_recipe_name)",
    "--fp8-param-gather": "FP8 parameters",
    "--fp8-amax-history-len": "FP8 training from Megatron flags (use model.quant_recipe_name)",
    "--fp8-amax-compute-algo": "FP8 training from Megatron flags (use model.quant_recipe_name)",
    "--expert-tensor-parallel-size": "a TP degree of its own for the experts",
    "--use-megatron-fsdp": "Megatron's own FSDP (meshforge's FSDP is PyTorch's: --use-distributed-optimizer)",
    "--data-parallel-sharding-strategy": "Megatron FSDP's sharding strategies",
    "--init-model-with-meta-device": "Megatron FSDP's meta init (meshforge always builds on meta)",
    "--moe-shared-expert-gate": "a gated shared expert (Qwen2-MoE)",
    "--moe-z-loss-coeff": "the router z-loss",
    "--moe-expert-capacity-factor": "expert capacity and token dropping",
    "--moe-flex-dispatcher-backend": "DeepEP / HybridEP dispatch",
    "--auto-detect-ckpt-format": "Megatron's checkpoint formats (meshforge reads DCP and HF folders)",
    "--dist-ckpt-strictness": "Megatron's dist-checkpoint loading",
    "--hybrid-override-pattern": "Megatron's hybrid Mamba/attention stack (pretrain_mamba.py)",
    "--hybrid-layer-pattern": "Megatron's hybrid Mamba/attention stack (pretrain_mamba.py)",
    "--is-hybrid-model": "Megatron's hybrid Mamba/attention stack (pretrain_mamba.py)",
    "--swap-attention": "MindSpeed's attention swap (memory.swap names the layers natively)",
    "--swap-optimizer": "optimizer-state swap to the host",
    "--mock-data": "synthetic data (name a corpus with --data-path)",
}


def _by_words(flag: str) -> FlagClass | None:
    if any(word in flag for word in _FUSION_WORDS):
        return FlagClass("warned", _FUSION)
    if any(word in flag for word in _COMM_WORDS):
        return FlagClass("warned", _COMM)
    return None


def classify(flag: str) -> FlagClass | None:
    """The class of a known flag; None for a name in no argument list."""
    if flag not in FLAGS:
        return None
    if flag in READ:
        return FlagClass("read", READ[flag])
    if flag in WARNED:
        return FlagClass("warned", WARNED[flag])
    if flag in REFUSED:
        return FlagClass("refused", REFUSED[flag])
    by_words = _by_words(flag)
    if by_words is not None:
        return by_words
    _takes, group, origin = FLAGS[flag]
    if group in WARNED_GROUPS:
        return FlagClass("warned", WARNED_GROUPS[group])
    where = f"{origin}'s {group!r} flags" if origin == "Megatron-LM" else f"a {origin} feature"
    return FlagClass("refused", where)


def takes(flag: str) -> str:
    """How many values `flag` takes: '0', '1', '+', '*' or a count."""
    return FLAGS[flag][0]


def markdown_table() -> str:
    """docs/config-mapping.md's Megatron section body: the read flags, then counts of the others."""
    lines = [
        f"Flag list: {MEGATRON_SOURCE} (`megatron/training/arguments.py`) and {DERIVED_SOURCE}: "
        f"{len(FLAGS)} flags, each read, warned or refused (`src/meshforge/config/megatron_table.py`).",
        "",
        "| Megatron flag | native path |",
        "| --- | --- |",
    ]
    lines += [f"| `{flag}` | {target} |" for flag, target in READ.items()]
    lines += ["", "Warned (no effect here, logged with the reason):", ""]
    lines += [f"- `{flag}`: {reason}" for flag, reason in WARNED.items()]
    lines += [f"- the {group!r} group: {reason}" for group, reason in WARNED_GROUPS.items()]
    lines += [
        f"- names with {', '.join(f'`{w}`' for w in _FUSION_WORDS + _COMM_WORDS)}: fusion, kernel or "
        "communication-schedule switches",
        "",
        "Refused (`not supported yet: --flag (feature)`), the named ones:",
        "",
    ]
    lines += [f"- `{flag}`: {feature}" for flag, feature in REFUSED.items()]
    lines += ["- every other flag: not supported yet, named by its Megatron-LM argument group or project"]
    return "\n".join(lines) + "\n"


def write_docs(path: str = "docs/config-mapping.md") -> None:
    """Put `markdown_table()` between the doc's `megatron-table` markers."""
    import re
    from pathlib import Path

    doc = Path(path)
    text = doc.read_text(encoding="utf-8")
    body = markdown_table()
    new = re.sub(
        r"(<!-- megatron-table:start -->\n).*?(<!-- megatron-table:end -->)",
        lambda m: m.group(1) + body + m.group(2),
        text,
        flags=re.S,
    )
    doc.write_text(new, encoding="utf-8")


if __name__ == "__main__":
    write_docs()
