#!/bin/bash
# A Megatron-style launch script (the shape of MindSpeed-LLM's examples/mcore/qwen3/pretrain_*.sh):
# a tiny Qwen3 (4 layers, hidden 256) pretrained from scratch on the bundled Megatron sample
# (assets/megatron/, written by `meshforge preprocess ... --append-eod`). The only change from a
# Megatron launch line is `pretrain_gpt.py` -> `-m meshforge megatron`. From the repository root:
#
#   bash configs/megatron/pretrain_qwen3_tiny.sh                         # runs the torchrun line below
#   meshforge train configs/megatron/pretrain_qwen3_tiny.sh              # the same run in one process
#   meshforge config import configs/megatron/pretrain_qwen3_tiny.sh -o qwen3_tiny.yaml   # as native YAML

NPROC_PER_NODE=${NPROC_PER_NODE:-1}
DATA_PATH="assets/megatron/python_docstrings_text_document"
TOKENIZER_PATH="assets/tokenizer"
CKPT_SAVE_DIR="output/megatron_qwen3_tiny"

TP=1
PP=1
MBS=4
GBS=16
SEQ_LENGTH=128
TRAIN_ITERS=10

DISTRIBUTED_ARGS="
    --nproc_per_node $NPROC_PER_NODE \
    --nnodes 1
"

GPT_ARGS="
    --use-mcore-models \
    --spec mindspeed_llm.tasks.models.spec.qwen3_spec layer_spec \
    --num-layers 4 \
    --hidden-size 256 \
    --ffn-hidden-size 768 \
    --num-attention-heads 4 \
    --group-query-attention \
    --num-query-groups 2 \
    --kv-channels 64 \
    --qk-layernorm \
    --max-position-embeddings 2048 \
    --make-vocab-size-divisible-by 1 \
    --padded-vocab-size 8192 \
    --rotary-base 1000000 \
    --disable-bias-linear \
    --swiglu \
    --normalization RMSNorm \
    --norm-epsilon 1e-6 \
    --position-embedding-type rope \
    --attention-dropout 0.0 \
    --hidden-dropout 0.0 \
    --tokenizer-type PretrainedFromHF \
    --tokenizer-name-or-path ${TOKENIZER_PATH}
"

TRAIN_ARGS="
    --micro-batch-size ${MBS} \
    --global-batch-size ${GBS} \
    --train-iters ${TRAIN_ITERS} \
    --lr 2e-3 \
    --min-lr 2e-4 \
    --lr-decay-style cosine \
    --lr-warmup-iters 2 \
    --weight-decay 0.1 \
    --clip-grad 1.0 \
    --adam-beta1 0.9 \
    --adam-beta2 0.95 \
    --seed 42 \
    --use-distributed-optimizer \
    --tensor-model-parallel-size ${TP} \
    --pipeline-model-parallel-size ${PP}
"

DATA_ARGS="
    --data-path ${DATA_PATH} \
    --data-cache-path ${CKPT_SAVE_DIR}/data_cache \
    --split 100,0,0 \
    --seq-length ${SEQ_LENGTH}
"

OUTPUT_ARGS="
    --log-interval 2 \
    --save ${CKPT_SAVE_DIR} \
    --save-interval 10 \
    --eval-iters 0
"

torchrun $DISTRIBUTED_ARGS -m meshforge megatron \
    $GPT_ARGS \
    $TRAIN_ARGS \
    $DATA_ARGS \
    $OUTPUT_ARGS
