"""DeepSeek-V3's MTP blocks in the memory plan: state and activations on the last pipeline stage,
with the embedding copy that stage holds for them."""

from __future__ import annotations

import torch

from meshforge.config import config_from_dict
from meshforge.config.root import TrainConfig
from meshforge.parallel.dims import ParallelDims
from meshforge.parallel.plan import (
    activation_plan,
    count_parameters,
    measure_plan_activations,
    rank_parameters,
)

SEQ, MICRO = 32, 2
DEEPSEEK = {
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "max_position_embeddings": 64,
    "num_nextn_predict_layers": 1,
}
PP2 = {"pipeline_parallel": 2, "pipeline_parallel_schedule": "1f1b"}


def _config(*, factor: float = 0.3, tied: bool = False, **model: int) -> TrainConfig:
    return config_from_dict(
        {
            "model": {**DEEPSEEK, "tie_word_embeddings": tied, **model},
            "train_dataset": {
                "dataloader": {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": SEQ}
            },
            "training": {
                "local_batch_size": MICRO,
                "global_batch_size": 4 * MICRO,
                "mtp_loss_scaling_factor": factor,
            },
            "parallelism": PP2,
        }
    )


def _model_params(cfg: TrainConfig) -> dict[str, int]:
    from meshforge.checkpoint.source import resolve_model_source

    source = resolve_model_source(cfg.model)
    with torch.device("meta"):
        model = source.family.build(source.options)
    return {name: p.numel() for name, p in model.named_parameters()}


def test_mtp_block_state_and_embedding_copy_are_on_the_last_stage() -> None:
    cfg = _config()
    dims = ParallelDims.from_config(cfg.parallelism, 2)
    _, counts = count_parameters(cfg)
    assert counts.mtp_layers == 1 and len(counts.layers) == 5
    params = _model_params(cfg)
    mtp = sum(n for name, n in params.items() if name.startswith("model.layers.4."))
    embedding = params["model.embed_tokens.weight"]
    first = embedding + sum(
        n for name, n in params.items() if name.startswith(("model.layers.0.", "model.layers.1."))
    )
    last = sum(
        n
        for name, n in params.items()
        if name.startswith(("model.layers.2.", "model.layers.3.", "lm_head", "model.norm"))
    )
    assert counts.layers[4] + counts.experts[4] == mtp > 0
    # One process per stage (no FSDP or EP): the last stage holds the MTP block and its embedding copy.
    assert rank_parameters(cfg, dims, counts) == [first, last + mtp + embedding]
    assert sum(rank_parameters(cfg, dims, counts)) == counts.total + embedding
    # Without PP the one embedding is the one the MTP block reads.
    one = ParallelDims.from_config(config_from_dict({"model": DEEPSEEK}).parallelism, 1)
    assert rank_parameters(cfg, one, counts) == [counts.total]
    # A tied head is the last stage's embedding copy already: counted once.
    tied = _config(tied=True)
    _, tied_counts = count_parameters(tied)
    assert rank_parameters(tied, dims, tied_counts)[1] == last - params["lm_head.weight"] + mtp + embedding


def test_mtp_block_activations_count_on_the_last_stage_when_trained() -> None:
    dims = ParallelDims.from_config(_config().parallelism, 2)
    rows = {}
    estimates = {}
    for factor in (0.3, 0.0):
        cfg = _config(factor=factor)
        _, counts = count_parameters(cfg)
        estimates[factor] = measure_plan_activations(cfg, MICRO, SEQ)
        rows[factor] = activation_plan(cfg, dims, counts, estimates[factor])
    on, off = estimates[0.3], estimates[0.0]
    assert off.layers[4].device == 0 and on.layers[4].device > on.layers[3].device
    assert on.outside > off.outside  # the MTP depth's logits and loss
    # Rank 0's stage is unchanged; rank 1 (1f1b, one micro-batch in flight) gains the block and its loss.
    assert rows[0.3][0] == rows[0.0][0]
    gained = rows[0.3][1].device_bytes - rows[0.0][1].device_bytes
    assert gained == on.layers[4].device + on.outside - off.outside
    assert rows[0.3][1].num_layers == 3
