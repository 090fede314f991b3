"""Every flag of Megatron-LM's `pretrain_gpt.py` parser and of the projects built on it (generated).

Written by `scripts/megatron_flag_list.py` from Megatron-LM d98e8a64ddf3
(`megatron/training/arguments.py`, the parser `add_megatron_arguments` builds), MindSpeed-LLM
c77308a14bfc (its `add_argument` calls) and MindSpeed 028de58ca629 (those of its
flags that MindSpeed-LLM's example scripts use). Do not edit by hand: run the script again.

Each group maps to `--flag:TAKES` words: TAKES is how many values the flag takes (0: a switch,
1: one value, `+`: one or more, `*`: any number, a number: exactly that many). What meshforge does
with each flag is `config/megatron_table.py`'s.
"""

from __future__ import annotations

MEGATRON_SOURCE = "Megatron-LM d98e8a64ddf3"
DERIVED_SOURCE = "MindSpeed-LLM c77308a14bfc, MindSpeed 028de58ca629"

MEGATRON: dict[str, str] = {
    "transformer configuration": (
        "--tensor-model-parallel-size:1 --tensor-parallel-num-weight-shards:1 "
        "--pipeline-model-parallel-comm-backend:1 --pipeline-model-parallel-size:1 --sequence-parallel:0 "
        "--context-parallel-size:1 --hierarchical-context-parallel-sizes:+ --max-seqlen-per-dp-cp-rank:1 "
        "--hybrid-context-parallel:0 --expert-model-parallel-size:1 --expert-tensor-parallel-size:1 "
        "--expert-tensor-parallel-num-weight-shards:1 --no-initialization:0 --use-cpu-initialization:0 "
        "--fp16:0 --bf16:0 --deterministic-mode:0 --tp-comm-overlap:0 --no-tp-comm-bulk-wgrad:0 "
        "--disable-tp-comm-bulk-wgrad:0 --no-tp-comm-bulk-dgrad:0 --disable-tp-comm-bulk-dgrad:0 "
        "--no-tp-comm-overlap-ag:0 --disable-tp-comm-overlap-ag:0 --no-tp-comm-overlap-rs:0 "
        "--disable-tp-comm-overlap-rs:0 --tp-comm-overlap-rs-dgrad:0 --no-tp-comm-split-ag:0 "
        "--disable-tp-comm-split-ag:0 --no-tp-comm-split-rs:0 --disable-tp-comm-split-rs:0 "
        "--cross-entropy-loss-fusion:0 --cross-entropy-fusion-impl:1 --tp-comm-bootstrap-backend:1 "
        "--overlap-moe-expert-parallel-comm:0 --delay-wgrad-compute:0 "
        "--overlap-dispatch-backward-with-experts-wgrad:0 --ep-overlap-early-attn-memory-release:0 "
        "--use-ring-exchange-p2p:0 --defer-embedding-wgrad-compute:0 --wgrad-deferral-limit:1 "
        "--overlap-p2p-communication-warmup-flush:0 --microbatch-group-size-per-virtual-pipeline-stage:1 "
        "--mtp-standalone:0 --cpu-offloading-num-layers:1 --cpu-offloading-retain-pinned-cpu-buffers:0 "
        "--num-layers:1 --mtp-num-layers:1 --mtp-loss-scaling-factor:1 --mtp-use-repeated-layer:0 "
        "--mtp-detach-heads:0 --mtp-hsm:0 --mtp-hybrid-override-pattern:1 "
        "--account-for-embedding-in-pipeline-split:0 --account-for-loss-in-pipeline-split:0 "
        "--hidden-size:1 --num-attention-heads:1 --attention-backend:1 --flash-attention-version:1 "
        "--softmax-type:1 --num-query-groups:1 --ffn-hidden-size:1 --kv-channels:1 --hidden-dropout:1 "
        "--attention-dropout:1 --fp32-residual-connection:0 --apply-residual-connection-post-layernorm:0 "
        "--norm-epsilon:1 --apply-layernorm-1p:0 --disable-bias-linear:0 --add-qkv-bias:0 "
        "--glu-linear-offset:1 --activation-func-clamp-value:1 --rotary-interleaved:0 --normalization:1 "
        "--qk-layernorm:0 --qk-l2-norm:0 --qk-clip:0 --qk-clip-alpha:1 --qk-clip-threshold:1 "
        "--attention-output-gate:0 --calculate-per-token-loss:0 --multi-latent-attention:0 "
        "--experimental-attention-variant:1 --dsa-indexer-n-heads:1 --dsa-indexer-head-dim:1 "
        "--dsa-indexer-topk:1 --dsa-indexer-topk-freq:1 --dsa-indexer-skip-topk-offset:1 "
        "--dsa-indexer-loss-coeff:1 --dsa-indexer-use-sparse-loss:0 --dsa-kernel-backend:1 "
        "--dsa-indexer-rope-interleaved:0 --no-dsa-indexer-rotate-activation:0 "
        "--disable-dsa-indexer-rotate-activation:0 --no-dsa-indexer-scoring-relu:0 "
        "--disable-dsa-indexer-scoring-relu:0 --dsa-indexer-k-norm-epsilon:1 --dsa-indexer-k-norm-fp32:0 "
        "--linear-conv-kernel-dim:1 --linear-key-head-dim:1 --linear-value-head-dim:1 "
        "--linear-num-key-heads:1 --linear-num-value-heads:1 --init-method-std:1 "
        "--embedding-init-method-std:1 --init-model-with-meta-device:0 --use-mup:0 --mup-width-mult:1 "
        "--mup-base-hidden-size:1 --mup-embedding-mult:1 --mup-output-mult:1 --mup-base-head-dim:1 "
        "--mup-attn-scale-power:1 --apply-query-key-layer-scaling:0 "
        "--disable-bf16-reduced-precision-matmul:0 --use-fused-weighted-squared-relu:0 "
        "--fused-residual-rmsnorm:0 --use-transformer-engine-op-fuser:0 --recompute-granularity:1 "
        "--recompute-method:1 --recompute-num-layers:1 --distribute-saved-activations:0 "
        "--recompute-modules:+ --fp8-format:1 --fp8-recipe:1 --fp8-quantizer-factory:1 --fp8-margin:1 "
        "--fp8-interval:1 --fp8-amax-history-len:1 --fp8-amax-compute-algo:1 --no-fp8-wgrad:0 "
        "--disable-fp8-wgrad:0 --fp8-output-proj:0 --first-last-layers-bf16:0 "
        "--num-layers-at-start-in-bf16:1 --num-layers-at-end-in-bf16:1 --use-kitchen-attention:0 "
        "--kitchen-attention-backend:1 --fp4-format:1 --fp4-recipe:1 --fp4-quantizer-factory:1 "
        "--high-priority-a2a-comm-stream:0 --moe-shared-expert-intermediate-size:1 "
        "--moe-shared-expert-gate:0 --moe-shared-expert-overlap:0 --use-grouped-gemm-for-shared-expert:0 "
        "--moe-shared-expert-glu-interleave-size:1 --moe-ffn-hidden-size:1 --moe-router-topk:1 "
        "--moe-enable-routing-replay:0 --moe-router-padding-for-quantization:0 "
        "--moe-router-padding-for-fp8:0 --moe-router-num-groups:1 --moe-router-group-topk:1 "
        "--moe-router-pre-softmax:0 --moe-router-topk-scaling-factor:1 --moe-router-score-function:1 "
        "--moe-router-dtype:1 --moe-router-enable-expert-bias:0 --moe-router-bias-update-rate:1 "
        "--moe-router-quantile-balancing-ema:1 --moe-router-force-load-balancing:0 "
        "--moe-router-force-biased:1 --use-grouped-gemm-for-dense-mlp:0 --moe-grouped-gemm:0 "
        "--moe-use-grouped-tensor:0 --moe-single-grouped-weight:0 --moe-single-grouped-bias:0 "
        "--moe-z-loss-coeff:1 --moe-input-jitter-eps:1 --moe-token-dispatcher-type:1 "
        "--moe-enable-deepep:0 --moe-flex-dispatcher-backend:1 --moe-permute-fusion-into-hybridep:0 "
        "--moe-hybridep-pad-uneven-dispatch-inputs:0 --moe-per-layer-logging:0 "
        "--moe-expert-capacity-factor:1 --moe-pad-expert-input-to-capacity:0 "
        "--moe-pad-experts-for-cuda-graph-inference:0 --moe-token-drop-policy:1 --moe-layer-recompute:0 "
        "--moe-permute-fusion:0 --moe-router-fusion:0 --moe-apply-probs-on-input:0 --moe-latent-size:1 "
        "--gtp-remat-opt-in-modules:+ --moe-flex-dispatcher-num-sms:1 --moe-deepep-num-sms:1 "
        "--moe-hybridep-num-sms:1 --moe-hybridep-num-blocks-permute:1 "
        "--moe-hybridep-num-blocks-unpermute:1 --moe-hybridep-num-sms-preprocessing:1 "
        "--moe-ncclep-zero-copy:0 --moe-dispatch-fwd-dtype:1 --moe-combine-bwd-dtype:1 "
        "--moe-mlp-glu-interleave-size:1 --moe-expert-rank-capacity-factor:1 --enable-cuda-graph:0 "
        "--cuda-graph-warmup-steps:1 --external-cuda-graph:0 --cuda-graph-impl:1 "
        "--inference-cuda-graph-scope:1 --enable-mhc-connections:0 --mhc-num-residual-streams:1 "
        "--mhc-sinkhorn-iterations:1 --mhc-init-gating-factor:1 --mhc-recompute-layer-num:1 "
        "--no-clone-scatter-output-in-embedding:0 --disable-clone-scatter-output-in-embedding:0 "
        "--config-logger-dir:1 --flash-decode:0 --batch-invariant-mode:0 --batch-invariant-backend:1 "
        "--use-te-activation-func:0 --symmetric-ar-type:1 --nccl-all-reduce-for-prefill:0 "
        "--inference-fuse-tp-communication:0 --inference-disable-triton-nvls-kernels:0 "
        "--inference-grouped-gemm-backend:1 --inference-moe-disable-fused-quant-kernels:0 "
        "--inference-moe-token-dispatcher-type:1 --mrope-section:+ --is-hybrid-model:0 "
        "--mamba-state-dim:1 --mamba-head-dim:1 --mamba-num-groups:1 --mamba-num-heads:1 "
        "--gdp-num-householder:1 --disable-mamba-mem-eff-path:0 --gdp-cutedsl-kernel:0 "
        "--gdp-num-chunk-states-to-recompute:1 --mlp-chunks-for-prefill:1 --mlp-chunks-for-training:1 "
        "--transformer-impl:1 --fine-grained-activation-offloading:0 --offload-modules:+ "
        "--min-offloaded-tensor-size:1 --delay-offload-until-cuda-graph:0 "
        "--delta-offload-bytes-across-pp-ranks:1 --activation-offload-fraction:1 --moe-paged-stash:0 "
        "--moe-paged-stash-page-size:1 --moe-paged-stash-buffer-size-factor-cuda:1 "
        "--moe-paged-stash-buffer-size-factor-cpu:1 --fine-grained-offloading-max-inflight-offloads:1"
    ),
    "network size": (
        "--encoder-num-layers:1 --decoder-num-layers:1 --group-query-attention:0 --window-size:1 "
        "--window-attn-skip-freq:1 --max-position-embeddings:1 --position-embedding-type:1 "
        "--yarn-original-max-position-embeddings:1 --yarn-beta-fast:1 --yarn-beta-slow:1 "
        "--yarn-correction-range-round-to-int:0 --no-yarn-correction-range-round-to-int:0 "
        "--relative-attention-num-buckets:1 --relative-attention-max-distance:1 "
        "--use-rotary-position-embeddings:0 --rotary-base:1 --rotary-percent:1 "
        "--rotary-seq-len-interpolation-factor:1 --use-rope-scaling:0 --rope-scaling-factor:1 "
        "--no-rope-freq:1 --no-position-embedding:0 --make-vocab-size-divisible-by:1 --openai-gelu:0 "
        "--squared-relu:0 --swiglu:0 --quick-geglu:0 --onnx-safe:1 --bert-no-binary-head:0 "
        "--untie-embeddings-and-output-weights:0"
    ),
    "regularization": (
        "--weight-decay:1 --apply-wd-to-qk-layernorm:0 --clip-grad:1 --adam-beta1:1 --adam-beta2:1 "
        "--adam-eps:1 --sgd-momentum:1 --muon-momentum:1 --muon-no-split-qkv:0 --muon-nesterov:0 "
        "--muon-scale-mode:1 --muon-fp32-matmul-prec:1 --muon-coefficient-type:1 --muon-num-ns-steps:1 "
        "--muon-tp-mode:1 --muon-use-syrk:0 --muon-extra-scale-factor:1 --muon-scalar-optimizer:1 "
        "--lion-beta1:1 --lion-beta2:1 --no-weight-decay-cond-type:1"
    ),
    "profiling": (
        "--profile:0 --profile-step-start:1 --profile-step-end:1 --use-pytorch-profiler:0 "
        "--pytorch-profiler-collect-shapes:0 --pytorch-profiler-collect-callstack:0 "
        "--pytorch-profiler-collect-chakra:0 --profile-ranks:+ --record-memory-history:0 "
        "--memory-snapshot-path:1 --record-shapes:0 --nvtx-ranges:0"
    ),
    "training": (
        "--micro-batch-size:1 --global-batch-size:1 --rampup-batch-size:3 --step-batch-size-schedule:1 "
        "--decrease-batch-size-if-needed:0 --empty-unused-memory-level:1 "
        "--check-weight-hash-across-dp-replicas-interval:1 --gpu-sniff-test-interval:1 "
        "--train-sync-interval:1 --train-iters:1 --train-samples:1 --exit-interval:1 "
        "--exit-duration-in-mins:1 --exit-signal-handler:0 --exit-signal:1 "
        "--exit-signal-handler-for-dataloader:0 --exit-signal-handler-for-training:0 --manual-gc:0 "
        "--manual-gc-interval:1 --no-manual-gc-eval:0 --disable-manual-gc-eval:0 --iterations-to-skip:+ "
        "--batch-size:1 --recompute-activations:0 --no-check-for-nan-in-loss-and-grad:0 "
        "--check-for-large-grads:0 --result-rejected-tracker-filename:1 --tp-comm-overlap-cfg:1 "
        "--checkpoint-activations:0 --no-masked-softmax-fusion:0 --no-bias-gelu-fusion:0 "
        "--no-bias-swiglu-fusion:0 --no-bias-dropout-fusion:0 --no-rope-fusion:0 --rope-type:1 "
        "--use-flash-attn:0 --optimizer:1 --optimizer-cpu-offload:0 --optimizer-cuda-graph:0 "
        "--optimizer-offload-fraction:1 --use-torch-optimizer-for-cpu-offload:0 "
        "--overlap-cpu-optimizer-d2h-h2d:0 --dump-param-to-param-group-map:1 --no-pin-cpu-grads:0 "
        "--no-pin-cpu-params:0 --dataloader-type:1 --no-persist-layer-norm:0 "
        "--no-gradient-accumulation-fusion:0 --use-mcore-models:0"
    ),
    "rl": (
        "--perform-rl-step:0 --rl-prompts-per-eval:1 --grpo-prompts-per-step:1 --grpo-group-size:1 "
        "--rl-generation-lag:1 --rl-max-inflight-requests:1 --rl-submission-granularity:1 "
        "--rl-consumption-granularity:1 --rl-durable-rollout-bank:0 --rl-rollout-bank-dir:1 "
        "--rl-rollout-bank-max-bytes:1 --grpo-iterations:1 --grpo-clamp-eps-lower:1 "
        "--grpo-clamp-eps-upper:1 --grpo-kl-beta:1 --grpo-entropy-term-weight:1 "
        "--grpo-filter-groups-with-same-reward:0 --langrl-env-config:1 --rl-default-temperature:1 "
        "--rl-default-top-p:1 --rl-default-top-k:1 --rl-offload-optimizer-during-inference:0 "
        "--rl-kv-cache-management-mode:1 --rl-persist-cuda-graphs:0 --no-rl-persist-cuda-graphs:0 "
        "--rl-partial-rollouts:0 --no-rl-partial-rollouts:0 --rl-inference-logprobs-is-correction:0 "
        "--no-rl-inference-logprobs-is-correction:0 --rl-importance-sampling-truncation-coef:1 "
        "--rl-use-sequence-packing:0 --no-rl-use-sequence-packing:0 "
        "--rl-sequence-packing-max-sequences-per-bin:1 --rl-sequence-packing-algo:1 "
        "--rl-training-cuda-graphs:0 --no-rl-training-cuda-graphs:0 "
        "--rl-inference-tensor-model-parallel-size:1 --rl-inference-pipeline-model-parallel-size:1 "
        "--rl-inference-expert-model-parallel-size:1 --rl-inference-expert-tensor-model-parallel-size:1 "
        "--rl-inference-model-unified-memory-level:1 --rl-offload-inference-model-weights-when-idle:0 "
        "--no-rl-offload-inference-model-weights-when-idle:0 --refit-method:1 "
        "--rl-verify-model-weights-swap:0 --no-rl-verify-model-weights-swap:0 --rl-skip-bos-token:0 "
        "--no-rl-skip-bos-token:0 --rl-profile:0 --rl-profile-dir:1 --rl-inference-parsers:*"
    ),
    "RNG and initialization": (
        "--seed:1 --te-rng-tracker:0 --inference-rng-tracker:0 --data-parallel-random-init:0 "
        "--init-method-xavier-uniform:0"
    ),
    "learning rate and weight decay": (
        "--lr-decay-style:1 --lr-wsd-decay-style:1 --lr-decay-iters:1 --lr-decay-samples:1 "
        "--lr-wsd-decay-iters:1 --lr-wsd-decay-samples:1 --lr-warmup-fraction:1 --lr-warmup-iters:1 "
        "--lr-warmup-samples:1 --lr-warmup-init:1 --override-opt_param-scheduler:0 "
        "--override-opt-param-scheduler:0 --use-checkpoint-opt_param-scheduler:0 "
        "--use-checkpoint-opt-param-scheduler:0 --start-weight-decay:1 --end-weight-decay:1 "
        "--weight-decay-incr-style:1 --lr:1 --warmup:1 --min-lr:1 --decoupled-lr:1 --decoupled-min-lr:1 "
        "--freeze-all-layers:0"
    ),
    "checkpointing": (
        "--save:1 --save-interval:1 --persistent-save-interval:1 --save-params-interval:1 "
        "--save-activations-interval:1 --save-tokens-per-expert-interval:1 --save-wgrads-interval:1 "
        "--save-dgrads-interval:1 --save-retain-interval:1 --load:1 --load-main-params-from-ckpt:0 "
        "--non-persistent-save-interval:1 --non-persistent-ckpt-type:1 --non-persistent-global-ckpt-dir:1 "
        "--non-persistent-local-ckpt-dir:1 --non-persistent-local-ckpt-algo:1 --finetune:0 "
        "--pretrained-checkpoint:1 --ckpt-step:1 --use-checkpoint-args:0 "
        "--use-mp-args-from-checkpoint-args:0 --no-use-tokenizer-model-from-checkpoint-args:0 "
        "--disable-use-tokenizer-model-from-checkpoint-args:0 --exit-on-missing-checkpoint:0 "
        "--ckpt-format:1 --auto-detect-ckpt-format:0 --ckpt-convert-format:1 --ckpt-convert-save:1 "
        "--ckpt-convert-update-legacy-dist-opt-format:0 --no-ckpt-fully-parallel-save:0 --async-save:0 "
        "--async-strategy:1 --use-persistent-ckpt-worker:0 --async-ckpt-cpu-priority:1 "
        "--async-ckpt-io-priority:1 --async-ckpt-use-cpu-shm:0 --ckpt-fully-parallel-load:0 "
        "--ckpt-fully-parallel-load-exchange-algo:1 --ckpt-fully-parallel-load-per-rank-objects:0 "
        "--ckpt-fully-parallel-save-process-group:1 --ckpt-fully-parallel-load-process-group:1 "
        "--ckpt-assume-constant-structure:0 --ckpt-pg-tensors-cache-path:1 "
        "--ckpt-pg-tensors-cache-create:0 --no-ckpt-load-validate-sharding-integrity:0 "
        "--disable-ckpt-load-validate-sharding-integrity:0 --no-strict-fsdp-dtensor-load:0 "
        "--disable-strict-fsdp-dtensor-load:0 --dist-ckpt-strictness:1 --dist-ckpt-save-pre-mcore-014:0 "
        "--dist-ckpt-optim-fully-reshardable:0 --distrib-optim-fully-reshardable-mem-efficient:0 "
        "--no-save-tokenizer-assets:0 --disable-save-tokenizer-assets:0 --replication:0 "
        "--replication-jump:1 --replication-factor:1 --verify-integrity:0 --no-save-optim:0 "
        "--no-save-rng:0 --no-load-optim:0 --no-load-rng:0 --override-ckpt-iteration:1 --use-dist-ckpt:0 "
        "--dist-ckpt-format:1 --dist-ckpt-workers:1 --ckpt-fully-parallel-save:0 "
        "--ckpt-drop-redundant-extra-state:0"
    ),
    "mixed precision": (
        "--grad-reduce-in-bf16:0 --loss-scale:1 --initial-loss-scale:1 --min-loss-scale:1 "
        "--loss-scale-window:1 --hysteresis:1 --attention-softmax-in-fp32:0 "
        "--accumulate-allreduce-grads-in-fp32:0 --fp16-lm-cross-entropy:0 --output-logit-dtype:1 "
        "--reuse-grad-buf-for-mxfp8-param-ag:0 --mamba-training-ssm-states-dtype:1"
    ),
    "distributed init": (
        "--distributed-backend:1 --distributed-timeout-minutes:1 --no-align-grad-reduce:0 "
        "--disable-align-grad-reduce:0 --local-rank:1 --lazy-mpu-init:0 --use-megatron-fsdp:0 "
        "--use-torch-fsdp2:0 --nccl-communicator-config-path:1 --use-tp-pp-dp-mapping:0 "
        "--disable-gloo-process-groups:0 --use-sharp:0 --sharp-enabled-group:1 "
        "--high-priority-stream-groups:+ --distributed-timeout-seconds-after-init:1 "
        "--flight-recorder-dump-path:1 --flight-recorder-trace-buffer-size:1 "
        "--no-flight-recorder-dump-on-timeout:0 --disable-flight-recorder-dump-on-timeout:0 "
        "--flight-recorder-include-stack-trace:0 --no-flight-recorder-include-only-active:0 "
        "--disable-flight-recorder-include-only-active:0 --no-flight-recorder-extra-dump-on-exec:0 "
        "--disable-flight-recorder-extra-dump-on-exec:0 --disable-jit-fuser:0 "
        "--decoder-first-pipeline-num-layers:1 --decoder-last-pipeline-num-layers:1 "
        "--pipeline-model-parallel-layout:1 --model-parallel-size:1 "
        "--num-layers-per-virtual-pipeline-stage:1 --num-virtual-stages-per-pipeline-rank:1 "
        "--no-overlap-p2p-communication:0 --overlap-grad-reduce:0 --ddp-num-buckets:1 --ddp-bucket-size:1 "
        "--ddp-pad-buckets-for-high-nccl-busbw:0 --ddp-reduce-scatter-with-fp32-accumulation:0 "
        "--gtp-remat-reduce-scatter-with-fp32-accumulation:0 "
        "--ddp-param-name-patterns-for-fp32-local-accumulation:+ --ddp-average-in-collective:0 "
        "--overlap-param-gather:0 --overlap-param-gather-with-optimizer-step:0 --no-align-param-gather:0 "
        "--use-distributed-optimizer:0 --megatron-fsdp-version:1 --no-use-layer-wise-param-layout:0 "
        "--use-nccl-ub:0 --disable-symmetric-registration:0 --gtp-remat-nccl-ub:0 "
        "--gtp-expert-remat-nccl-ub:0 --fsdp-manual-registration:0 --create-all-gather-group:0 "
        "--data-parallel-sharding-strategy:1 --outer-dp-sharding-strategy:1 "
        "--no-gradient-reduce-div-fusion:0 --fsdp-double-buffer:0 --suggested-communication-unit-size:1 "
        "--keep-fp8-transpose-cache:0 --enable-full-sharding-in-hsdp:0 "
        "--num-distributed-optimizer-instances:1 --torch-fsdp2-no-reshard-after-forward:0 "
        "--cp-comm-type:+ --fake-process-group:0"
    ),
    "validation": (
        "--eval-iters:1 --eval-interval:1 --start-eval-at-iter:1 --eval-global-batch-size:1 "
        "--eval-micro-batch-size:1 --skip-train:0 --test-mode:0 --full-validation:0 "
        "--multiple-validation-sets:0 --validation-set-names:+"
    ),
    "data and dataloader": (
        "--data-path:* --phase-transition-iterations:1 --split:1 --train-data-path:* --valid-data-path:* "
        "--test-data-path:* --data-args-path:1 --per-split-data-args-path:1 "
        "--per-dataset-sequences-path:1 --dataloader-fast-cache-load:0 "
        "--dataloader-defer-npy-index-mmap:0 --data-cache-path:1 --no-mmap-bin-files:0 --mock-data:0 "
        "--seq-length:1 --encoder-seq-length:1 --decoder-seq-length:1 --sample-rate:1 --mask-prob:1 "
        "--short-seq-prob:1 --num-workers:1 --reset-position-ids:0 --reset-attention-mask:0 "
        "--dataloader-inter-document-masking:0 --eod-mask-loss:0 "
        "--no-create-attention-mask-in-dataloader:0 --num-dataset-builder-threads:1 "
        "--object-storage-cache-path:1 --mid-level-dataset-surplus:1 --allow-ambiguous-pad-tokens:0 "
        "--fim-data:0 --fim-rate:1 --fim-spm-rate:1 --fim-split-sample:1 --fim-fragment-rate:1 "
        "--fim-no-prefix:1 --fim-prefix-token:1 --fim-middle-token:1 --fim-suffix-token:1 "
        "--fim-pad-token:1 --fim-eod-token:1"
    ),
    "tokenizer": (
        "--vocab-size:1 --padded-vocab-size:1 --no-pad-vocab-size:0 --disable-pad-vocab-size:0 "
        "--vocab-file:1 --merge-file:1 --vocab-extra-ids:1 --tokenizer-type:1 --tokenizer-model:1 "
        "--tokenizer-metadata:1 --tokenizer-special-tokens:+ --tiktoken-pattern:1 "
        "--tiktoken-num-special-tokens:1 --tokenizer-sentencepiece-legacy:0 "
        "--no-tokenizer-sentencepiece-ignore-extra-whitespaces:0 "
        "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces:0 --tokenizer-hf-no-use-fast:0 "
        "--tokenizer-hf-no-include-special-tokens:0 --trust-remote-code:0 --null-tokenizer-eod-id:1 "
        "--null-tokenizer-pad-id:1 --chat-template:1 --use-gigatoken:0"
    ),
    "autoresume": ("--adlr-autoresume:0 --adlr-autoresume-interval:1"),
    "biencoder": (
        "--ict-head-size:1 --biencoder-projection-dim:1 --biencoder-shared-query-context-model:0 "
        "--ict-load:1 --bert-load:1 --titles-data-path:1 --query-in-block-prob:1 --use-one-sent-docs:0 "
        "--evidence-data-path:1 --retriever-report-topk-accuracies:+ --retriever-score-scaling:0 "
        "--block-data-path:1 --embedding-path:1 --indexer-batch-size:1 --indexer-log-interval:1"
    ),
    "vision": (
        "--num-classes:1 --img-h:1 --img-w:1 --num-channels:1 --patch-dim:1 --classes-fraction:1 "
        "--data-per-class-fraction:1 --no-data-sharding:0 --head-lr-mult:1 --vision-pretraining:0 "
        "--vision-pretraining-type:1 --vision-backbone-type:1 --swin-backbone-type:1 --mask-type:1 "
        "--mask-factor:1 --iter-per-epoch:1 --dino-local-img-size:1 --dino-local-crops-number:1 "
        "--dino-head-hidden-size:1 --dino-bottleneck-size:1 --dino-freeze-last-layer:1 "
        "--dino-norm-last-layer:0 --dino-warmup-teacher-temp:1 --dino-teacher-temp:1 "
        "--dino-warmup-teacher-temp-epochs:1"
    ),
    "moe": (
        "--num-experts:1 --moe-layer-freq:1 --moe-use-upcycling:0 --moe-router-load-balancing-type:+ "
        "--moe-aux-loss-coeff:+ --moe-upcycling-granularity:1"
    ),
    "mla": (
        "--q-lora-rank:1 --kv-lora-rank:1 --qk-head-dim:1 --qk-pos-emb-head-dim:1 --v-head-dim:1 "
        "--rotary-scaling-factor:1 --mscale:1 --mscale-all-dim:1 --cache-mla-latents:0 "
        "--mla-down-proj-fusion:0"
    ),
    "experimental_attention_variant": ("--linear-attention-freq:1"),
    "heterogeneous architecture": (
        "--heterogeneous-layers-config-path:1 --heterogeneous-layers-config-encoded-json:1"
    ),
    "logging": (
        "--log-interval:1 --log-params-norm:0 --log-throughput:0 --log-progress:0 --timing-log-level:1 "
        "--timing-log-option:1 --tensorboard-dir:1 --tensorboard-log-interval:1 "
        "--tensorboard-queue-size:1 --log-timers-to-tensorboard:0 --no-log-loss-scale-to-tensorboard:0 "
        "--disable-log-loss-scale-to-tensorboard:0 --log-validation-ppl-to-tensorboard:0 "
        "--log-memory-to-tensorboard:0 --log-memory-interval:1 --log-device-memory-used:0 "
        "--log-num-zeros-in-grad:0 --log-max-attention-logit:0 --no-barrier-with-level-1-timing:0 "
        "--log-world-size-to-tensorboard:0 --wandb-project:1 --wandb-exp-name:1 --wandb-save-dir:1 "
        "--wandb-entity:1 --logging-level:1 --log-energy:0 --moe-routing-trace-path:1 "
        "--moe-routing-trace-max-training-iters:1 --moe-routing-trace-capture-logits:0 "
        "--moe-routing-trace-capture-hidden-states:0 --moe-routing-trace-dump-weights:0"
    ),
    "opentelemetry": ("--otel-enabled:0 --otel-service-name:1 --otel-span-groups:1"),
    "Logits Distillation": (
        "--logits-save-top-k:1 --logits-save-top-p:1 --logits-save-top-p-min-k:1 --logits-save-dir:1 "
        "--logits-save-dtype:1 --logits-load-dir:1 --logits-load-decode-threads:1 "
        "--logits-load-prefetch-factor:1 --logits-load-msc-prefetch-depth:1 --logits-load-kd-loss-alpha:1 "
        "--logits-load-ignore-errors:0"
    ),
    "straggler": (
        "--log-straggler:0 --straggler-ctrlr-port:1 --straggler-minmax-count:1 "
        "--disable-straggler-on-startup:0"
    ),
    "workload inspector": ("--run-workload-inspector-server:0"),
    "inference": (
        "--inference-batch-times-seqlen-threshold:1 --max-tokens-to-oom:1 --output-bert-embeddings:0 "
        "--bert-embedder-type:1 --cuda-graph-scope:+ --cuda-graph-modules:+ --use-legacy-static-engine:0 "
        "--inference-max-requests:1 --inference-max-seq-length:1 --inference-dynamic-batching:0 "
        "--inference-dynamic-batching-buffer-size-gb:1 "
        "--inference-dynamic-batching-paused-buffer-size-gb:1 "
        "--inference-dynamic-batching-mamba-memory-ratio:1 --inference-dynamic-batching-block-size:1 "
        "--inference-dynamic-batching-max-requests:1 --inference-dynamic-batching-max-tokens:1 "
        "--inference-dynamic-batching-num-cuda-graphs:1 "
        "--inference-dynamic-batching-track-paused-request-events:0 "
        "--inference-dynamic-batching-track-generated-token-events:0 --decode-only-cuda-graphs:0 "
        "--inference-cuda-graph-all-prefills:0 --inference-cuda-graph-max-tokens:1 "
        "--inference-dynamic-batching-unified-memory-level:1 --enable-chunked-prefill:0 "
        "--num-speculative-tokens:1 --inference-dynamic-batching-prefix-caching:0 "
        "--no-inference-dynamic-batching-prefix-caching:0 "
        "--inference-dynamic-batching-prefix-caching-eviction-policy:1 "
        "--inference-dynamic-batching-prefix-caching-coordinator-policy:1 "
        "--inference-dynamic-batching-prefix-caching-routing-alpha:1 "
        "--inference-dynamic-batching-prefix-caching-mamba-gb:1 "
        "--inference-dynamic-batching-cuda-graph-mixed-prefill-count:1 "
        "--inference-dynamic-batching-cuda-graph-sizing-distribution:1 "
        "--inference-dynamic-batching-sampling-backend:1 --use-same-sampling-seed-across-dp-ranks:0 "
        "--inference-dynamic-batching-async-sched-mode:1 --inference-dynamic-batching-logprobs-mode:1 "
        "--inference-logging-step-interval:1 --inference-text-gen-server-logging:0 "
        "--no-inference-text-gen-server-logging:0 --inference-wandb-logging:0 "
        "--no-inference-wandb-logging:0 --inference-coordinator-port:1 "
        "--mamba-inference-conv-states-dtype:1 --mamba-inference-ssm-states-dtype:1 "
        "--inference-use-synchronous-zmq-collectives:0 --no-inference-use-synchronous-zmq-collectives:0 "
        "--inference-disable-ep-consensus:0 --no-inference-disable-ep-consensus:0 --inference-shards:1"
    ),
    "Transformer-Engine": ("--fp4-param-gather:0 --fp8-param-gather:0 --te-precision-config-file:1"),
    "experimental": (
        "--enable-experimental:0 --spec:* --hybrid-layer-pattern:1 --hybrid-override-pattern:1 "
        "--yaml-cfg:1 --use-precision-aware-optimizer:0 --main-grads-dtype:1 --main-params-dtype:1 "
        "--exp-avg-dtype:1 --exp-avg-sq-dtype:1 --megatron-fsdp-main-params-dtype:1 "
        "--megatron-fsdp-main-grads-dtype:1 --megatron-fsdp-grad-comm-dtype:1 "
        "--megatron-fsdp-enable-fine-grained-param-gather:0 --megatron-fsdp-max-pool-double-buffer:0 "
        "--fsdp-db-use-persist-buf-on-alloc-fail:0"
    ),
    "one logger": (
        "--no-one-logger:0 --one-logger-project:1 --one-logger-run-name:1 --one-logger-async:0 "
        "--app-tag-run-name:1 --app-tag-run-version:1"
    ),
    "In-process restart": (
        "--inprocess-restart:0 --inprocess-max-iterations:1 --inprocess-monitor-thread-interval:1 "
        "--inprocess-monitor-process-interval:1 --inprocess-progress-watchdog-interval:1 "
        "--inprocess-heartbeat-interval:1 --inprocess-soft-timeout:1 --inprocess-hard-timeout:1 "
        "--inprocess-heartbeat-timeout:1 --inprocess-barrier-timeout:1 --inprocess-completion-timeout:1 "
        "--inprocess-last-call-wait:1 --inprocess-termination-grace-time:1 --inprocess-granularity:1 "
        "--inprocess-active-world-size:1 --inprocess-empty-cuda-cache:0"
    ),
    "ft_package": ("--enable-ft-package:0 --calc-ft-timeouts:0 --ft-num-warmup-iters:1"),
    "rerun engine": (
        "--error-injection-rate:1 --error-injection-type:1 --rerun-mode:1 --check-for-spiky-loss:0"
    ),
    "msc": ("--enable-msc:0 --disable-msc:0"),
    "sft": ("--sft:0 --sft-tokenizer-prompt-format:1"),
    "fault injector": (
        "--fault-injector-ranks:1 --fault-injector-num-ranks:1 --fault-injector-fault-types:1 "
        "--fault-injector-fault-probabilities:1 --fault-injector-fault-delay:1 "
        "--fault-injector-delay-start-iteration:1 --fault-injector-mtti-seconds:1 "
        "--fault-injector-offset-seconds:1 --fault-injector-seed:1"
    ),
}

DERIVED: dict[str, str] = {
    "MindSpeed-LLM": (
        "--add-dense-bias:0 --add-eos-token:+ --add-output-layer-bias:0 --add-rmsnorm-offset:0 "
        "--ai-framework:1 --alibi-fusion-attn-type:1 --alternative-prompt:0 --append-eod:0 "
        "--apply-rope-no-in-complex:0 --async-log-allreduce:0 --attention-mask-type:1 "
        "--attn-logit-softcapping:1 --beta-fast:1 --beta-slow:1 --broadcast:0 --cache-dir:1 "
        "--chain-of-thought:0 --ckpt-cfg-path:1 --cla-share-factor:1 --compress-ratios:+ "
        "--compress-rope-theta:1 --context-parallel-algo:1 --cp-attention-mask-type:1 --cp-window-size:1 "
        "--cut-max-seqlen:0 --cvt-type:1 --dataset-additional-keys:* --dataset-dir:1 --dataset-impl:1 "
        "--datasets:+ --dim-model-base:1 --distributed-optimizer-no-replica:0 --dpo-beta:1 "
        "--dpo-label-smoothing:1 --dpo-loss-type:1 --drop-thinking:1 --dynamic-factor:1 "
        "--embedding-multiplier-scale:1 --enable-a2avc:1 --enable-dsa-indexer:0 "
        "--enable-elastic-training:0 --enable-hbmfault-repair:0 --enable-hf2mg-convert:0 "
        "--enable-high-availability:0 --enable-mg2hf-convert:0 --enable-mhc:0 --enable-mla-absorb:0 "
        "--enable-mla-scale-kv-lora:0 --enable-mla-scale-q-lora:0 --enable-seq1f1b:0 "
        "--enable-share-memory:0 --enable-thinking:1 --enable-worker-reboot:0 --eval-language:1 "
        "--evaluation-batch-size:1 --fc-type:1 --fill-neg-inf:0 --first-k-dense-replace:1 --fix-router:0 "
        "--fix-sub-seq-length:1 --fp8-reuse-quantized-weight:0 --full-attention-interval:1 "
        "--full-shuffle-instruction-dataset:0 --geglu:0 --gelu-tanh:0 --greedy:0 --handler-name:1 "
        "--hc-eps:1 --hc-mult:1 --hc-sinkhorn-iters:1 --hf-cfg-dir:1 --hf-chat-template:0 "
        "--hf-datasets-params:1 --hf-dir:1 --hf-save-dir:1 --high-freq-factor:1 --history-turns:1 "
        "--index-head-dim:1 --index-n-heads:1 --index-share-for-mtp-iteration:0 "
        "--index-skip-topk-offset:1 --index-topk:1 --index-topk-freq:1 --index-topk-pattern:1 "
        "--indexer-loss-coeff:1 --indexer-qk-quant-scheme:1 --init-norm-weight-in-fp32:0 --input:1 "
        "--input-embeds-norm:0 --input-jitter:0 --input-layernorm-in-fp32:0 --instruction-template:1 "
        "--interleave-probs:1 --interleave-sliding-window:1 --is-instruction-dataset:0 "
        "--is-pairwise-dataset:0 --iteration:1 --jit-compile:0 --json-keys:+ --keep-newlines:0 "
        "--kv-compress:0 --kv-head-repeat-before-uly-alltoall:0 --layerwise-disaggregated-training:0 "
        "--load-checkpoint-loosely:0 --load-dir:1 --load-dir-cloud:1 --load-dir-edge:1 "
        "--load-model-type:? --loader:1 --long-factor:1 --long-mscale:1 --longrope-freqs-type:1 "
        "--lora-alpha:1 --lora-ckpt-filter:0 --lora-fusion:0 --lora-load:1 --lora-modules-to-save:+ "
        "--lora-r:1 --lora-register-forward-hook:+ --lora-target-modules:+ --loss-chunk-size:1 "
        "--loss-compute-mode:1 --low-freq-factor:1 --lu-lora-final-layer-index:1 --lu-lora-lr:1 "
        "--lu-lora-lr-ratio:1 --mamba-chunk-size:1 --mamba-d-conv:1 --mamba-d-ssm:1 --mamba-expand:1 "
        "--map-keys:1 --max-batch-size:1 --max-eval-samples:1 --max-length:1 --max-new-tokens:1 "
        "--max-queue-size:1 --max-samples:1 --megatron-cp-in-bnsd:0 --merge-cloud-stages:1 "
        "--merge-group-keys:+ --merge-stages:1 --mg-dir:1 --mg-save-dir:1 --middle-ranks:1 "
        "--middle-stages:1 --mix-strategy:1 --mla-fa-divide-qk:0 --mla-fa-without-pad:0 --mla-mm-split:0 "
        "--mla-swap-core-attn-out:0 --mla-up-proj-tp-overlap:0 --mla-zero-memory:0 --moba-calc-method:1 "
        "--moba-chunk-size:1 --moba-topk:1 --model-config-file:1 --model-configs:1 --model-index-file:1 "
        "--model-name:1 --model-name-or-path:1 --model-type:1 --model-type-hf:1 "
        "--moe-comm-aux-loss-coeff:1 --moe-device-level-aux-loss-coeff:1 --moe-intermediate-size:1 "
        "--moe-revert-type-after-topk:0 --moe-tp-extend-ep:0 --mtp-mem-efficient-logits:0 --mtp-spec:* "
        "--multi-head-latent-attention:0 --n-group:1 --n-hash-layers:1 --n-subs:1 --neat-pack:0 "
        "--next-tockens:1 --no-chat-template:0 --no-checking:0 --no-cut-token:0 --no-enable-linear-qkv:0 "
        "--no-pad-to-seq-lengths:0 --no-post-layer-norm:0 --no-shared-storage:0 --no-shuffle:0 "
        "--no-use-gmm-fp8:0 --no-use-sparse-c8-indexer:0 --noop-layers:1 --norm-topk-prob:0 "
        "--num-cloud-vpp-chunks:1 --num-layer-list:1 --num-zero-experts:1 --o-groups:1 --o-lora-rank:1 "
        "--o2-gradient:0 --o2-optimizer:0 --only-convert-last-checkpoint:0 --origin-postprocess:0 "
        "--original-max-position-embeddings:1 --original-seq-len:1 --output-layer-slice-num:1 "
        "--output-logit-softcapping:1 --output-multiplier-scale:1 --output-prefix:1 --overwrite-cache:0 "
        "--pack:0 --pad-to-multiple-of:1 --pad-vocab-size-to:1 --padded-base-length:1 --padded-samples:0 "
        "--partial-rotary-factor:1 --post-norm:0 --pre-tockens:1 --pref-ftx:1 "
        "--profile-data-simplification:0 --profile-export-type:1 --profile-level:1 "
        "--profile-record-shapes:0 --profile-save-path:1 --profile-with-cpu:0 --profile-with-memory:0 "
        "--profile-with-stack:0 --prompt-type:1 --prompt-type-path:1 --qat-quant-block-size:1 "
        "--qat-scheme:1 --qk-nope-head-dim:1 --qk-rope-head-dim:1 --quant-grads:0 --quant-states:1 "
        "--query-pre-attn-scalar:1 --reasoning-effort:1 --recompute-mla-up-proj:0 --ref-model:1 "
        "--refer-model-iter:1 --reward-tokens:+ --rmsnorm-weight-in-fp32:0 --rope-factor:1 "
        "--rope-scaling-beta-fast:1 --rope-scaling-beta-slow:1 --rope-scaling-mscale:1 "
        "--rope-scaling-mscale-all-dim:1 --rope-scaling-original-max-position-embeddings:1 "
        "--rope-scaling-type:1 --rope-theta:1 --routed-scaling-factor:1 --router-gating-in-fp32:0 "
        "--save-dir:1 --save-dir-cloud:1 --save-dir-edge:1 --save-layer-by-layer:0 --save-lora-to-hf:0 "
        "--save-model-type:1 --saver:1 --scale-depth:1 --scale-emb:1 --scale-fmt:1 --schedules-method:1 "
        "--script-data-dir:1 --seq-aux:0 --seq1f1b-balance-method:1 --seq1f1b-splits:1 --shape-order:1 "
        "--shard-size:1 --share-kvstates:0 --shared-expert-gate:0 --shared-expert-gate-output-dimension:1 "
        "--short-factor:1 --short-mscale:1 --skip-bias-add:0 --sliding-window:1 --sliding-window-size:1 "
        "--sparse-mode:1 --split-cloud-rank:1 --split-rank:1 --split-sentences:0 --square-alibi-mask:0 "
        "--stage:1 --streaming:0 --swap-layer-input:0 --swiglu-limit:1 --target-expert-parallel-size:1 "
        "--target-pipeline-parallel-size:1 --target-tensor-parallel-size:1 --task:* --task-data-path:* "
        "--te-comparison-with-bf16:0 --te-comparison-with-cpu:0 --te-gmm-mode:1 --temperature:1 "
        "--tokenizer-name-or-path:1 --tokenizer-not-use-fast:0 --tokenizer-padding-side:1 --top-k:1 "
        "--top-p:1 --topk-group:1 --topk-softmax-in-fp32:0 --tp-2d:0 --tp-x:1 --tp-y:1 "
        "--use-cp-send-recv-overlap:0 --use-deter-comp:0 --use-fused-lightning-indexer:0 "
        "--use-fused-lightning-indexer-loss:0 --use-fused-mhc:0 --use-fused-ring-attention-update:0 "
        "--use-fused-rotary-pos-emb:0 --use-glm-rope:0 --use-global-aux-loss:0 --use-kv-cache:0 "
        "--use-mc2:0 --use-moba-attn:0 --use-sparse-flash-attn:0 --use-triton-gdn:0 --use-triton-mhc:0 "
        "--use-triton-swiglu-limit:0 --use-wandb:0 --variable-seq-lengths:0 --workers:1"
    ),
    "MindSpeed": (
        "--coc-fused-kernel:0 --disable-gloo-group:0 --gemm-gradient-accumulation-fusion:0 "
        "--moe-alltoall-overlap-comm:0 --moe-fb-overlap:0 --moe-permutation-async-comm:0 "
        "--moe-zero-memory:1 --n-shared-experts:1 --nnodes:1 --npu-deterministic:0 "
        "--recompute-activation-function:0 --reuse-fp32-param:0 --swap-attention:0 --swap-optimizer:0 "
        "--swap-optimizer-times:1 --ulysses-degree-in-cp:1 --use-ascend-coc:0 --use-ascend-mc2:0 "
        "--use-fused-moe-token-permute-and-unpermute:0 --use-fused-rmsnorm:0 --use-fused-swiglu:0"
    ),
}


def _parse(groups: dict[str, str], origin: str) -> dict[str, tuple[str, str, str]]:
    out: dict[str, tuple[str, str, str]] = {}
    for group, words in groups.items():
        for word in words.split():
            flag, takes = word.rsplit(":", 1)
            out.setdefault(flag, (takes, group, origin))
    return out


# flag -> (TAKES, group title, origin: "Megatron-LM" or the derived project's name)
FLAGS: dict[str, tuple[str, str, str]] = {
    **_parse(MEGATRON, "Megatron-LM"),
    **{flag: (t, g, g) for flag, (t, g, _o) in _parse(DERIVED, "").items()},
}
